"""Which model a stage's layers belong to, checked where a stage meets the head.

The head serves one model, known by its content key (models/content_hash.py, recorded in the split's
manifest as `source_sha256`, sent in every Assign as `model_sha256`). A stage keeps the layers it
loaded across a rejoin, and keeps cached shards and their side files between runs; both must be of
the head's model before they serve it:
- at join, a stage announces the model of the layers it holds (HELLO capability `model_sha256`) and
  the head refuses it while that is another model, saying so; the stage then drops those layers and
  joins again holding none (so a board never holds two models' layers at once);
- at assignment, a shard directory whose manifest names another model (a cache entry whose side files
  came with another model's assignment, the head's split on the same host re-cut since) is not loaded
  as it is.
Either key empty (a peer older than protocol 1.6, a split made before content keys) checks nothing.
"""
from __future__ import annotations

from typing import Any

from flowedge.models.content_hash import short
from flowedge.models.shards import Manifest

HELD_KEY = "model_sha256"         # the HELLO capability, and the stage's heartbeat stat shown in status
MISMATCH = "holds layers of another model"   # in the head's refusal; the stage drops its layers on it


def held(model_sha256: str) -> dict[str, Any]:
    """The HELLO capability for the layers a stage holds (none: nothing to announce)."""
    return {HELD_KEY: model_sha256} if model_sha256 else {}


def join_refusal(capabilities: dict[str, Any], served: str) -> str | None:
    """Why the head refuses a stage holding another model's layers (None: it may join)."""
    holds = capabilities.get(HELD_KEY)
    if not served or not isinstance(holds, str) or not holds or holds == served:
        return None
    return (f"this stage {MISMATCH}: it holds sha256 {short(holds)}…, the head serves sha256 {short(served)}…; "
            "it drops them and joins again")


def is_mismatch(reason: str) -> bool:
    """Whether a refused HELLO was refused for the layers the stage holds."""
    return MISMATCH in reason


def manifest_mismatch(manifest: Manifest, assigned: str) -> str | None:
    """Why a shard directory with `manifest` is not of the assigned model (None: it is, or unknown)."""
    if not assigned or not manifest.source_sha256 or manifest.source_sha256 == assigned:
        return None
    return (f"its manifest was cut from model sha256 {short(manifest.source_sha256)}…, the head serves "
            f"{short(assigned)}…")

"""Draft-head files: one safetensors file of W8A16 Linears (int8 codes + a float32 scale per 32 inputs,
models/quant8.py) and float32 norms, biases and the reduced vocabulary, its config in the metadata, its
sha256 in a `.sha256` sidecar that loading checks (a head shipped in the package is also pinned in
models/draft_head_spec.py). Which file a `--draft` spec names: models/draft_head_spec.py.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from torch import nn

from flowedge.errors import ModelError
from flowedge.models.draft_head import DraftHead, DraftHeadConfig
from flowedge.models.draft_head_spec import (SHIPPED_DIR, SHIPPED_SHA256, is_head_spec, resolve_head, sidecar,
                                             trained_path)
from flowedge.models.safetensors_io import TensorEntry, file_sha256, write_safetensors

log = logging.getLogger(__name__)

__all__ = ["is_head_spec", "load_head", "read_config", "resolve_head", "save_head", "sidecar", "trained_path",
           "verify"]

FORMAT = "flowedge-draft-head"
FORMAT_VERSION = "1"


def save_head(head: DraftHead, path: Path | str) -> str:
    """Write `head` (float weights, quantized here to W8A16) and its sidecar; returns the file's sha256."""
    from flowedge.models.quant8 import pack_int8

    path = Path(path)
    entries: list[TensorEntry] = []

    def add(name: str, t: torch.Tensor) -> None:
        t = t.detach().contiguous()
        entries.append(TensorEntry.held(name, t))

    for name, linear in head.linears().items():
        if not isinstance(linear, nn.Linear):
            raise ModelError(f"a head is saved from its float weights: {name} is a {type(linear).__name__}")
        w = pack_int8(linear.weight.detach().float().cpu())
        add(f"{name}.qweight", w.qweight)
        add(f"{name}.scales", w.scales)
        if linear.bias is not None:
            add(f"{name}.bias", linear.bias.detach().float().cpu())
    for name, t in _plain_tensors(head).items():
        add(name, t.float().cpu())
    add("vocab_ids", head.vocab_ids.to(torch.int32).cpu())
    meta = {"format": FORMAT, "version": FORMAT_VERSION, "config": json.dumps(head.config.to_dict())}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    sha, _ = write_safetensors(tmp, entries, meta)
    tmp.replace(path)
    sidecar(path).write_text(sha + "\n")
    return sha


def _plain_tensors(head: DraftHead) -> dict[str, torch.Tensor]:
    layer = head.layer
    return {"embed_norm.weight": head.embed_norm.weight, "feat_norm.weight": head.feat_norm.weight,
            "layer.input_layernorm.weight": layer.input_layernorm.weight,
            "layer.post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
            "norm.weight": head.norm.weight}


def read_config(path: Path | str) -> DraftHeadConfig:
    """The head's config from its file's metadata (nothing else read)."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot read draft head {path}: {e}") from e
    if meta.get("format") != FORMAT:
        raise ModelError(f"{path} is not a flowedge draft head")
    if meta.get("version") != FORMAT_VERSION:
        raise ModelError(f"{path}: draft head format {meta.get('version')!r}, this flowedge reads {FORMAT_VERSION}")
    return DraftHeadConfig.from_dict(json.loads(meta["config"]))


def verify(path: Path, expected: str | None = None) -> str:
    """Check the file against `expected` (a pinned sha256) or its sidecar; ModelError when they differ."""
    want = expected
    if want is None:
        if not sidecar(path).is_file():
            raise ModelError(f"draft head {path} has no {sidecar(path).name}: cannot check it")
        want = sidecar(path).read_text().strip()
    got = file_sha256(path)
    if got != want:
        raise ModelError(f"draft head {path} is corrupt: sha256 {got[:12]}…, expected {want[:12]}…")
    return got


def load_head(path: Path | str) -> DraftHead:
    """A head ready to run (W8A16 Linears, float32 norms); its lm_head rows still to attach."""
    from safetensors import safe_open

    from flowedge.models.quant8 import Int8Linear, PackedInt8

    path = Path(path)
    config = read_config(path)
    verify(path, SHIPPED_SHA256.get(path.stem) if path.parent == SHIPPED_DIR else None)
    with safe_open(str(path), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    with torch.device("meta"):
        head = DraftHead(config)
    try:
        for name in head.linears():
            w = PackedInt8(tensors[f"{name}.qweight"], tensors[f"{name}.scales"])
            w.check(name)
            head.set_submodule(name, Int8Linear.from_packed(w, tensors.get(f"{name}.bias")))
        state = {name: tensors[name] for name in _plain_tensors(head)}
        state["vocab_ids"] = tensors["vocab_ids"].to(torch.long)
    except KeyError as e:
        raise ModelError(f"draft head {path} lacks tensor {e.args[0]}") from e
    head.load_state_dict(state, strict=False, assign=True)
    meta = [n for n, t in (*head.named_parameters(), *head.named_buffers()) if t.is_meta]
    if meta:
        raise ModelError(f"draft head {path}: nothing stored for {', '.join(meta[:4])}")
    return head.eval()

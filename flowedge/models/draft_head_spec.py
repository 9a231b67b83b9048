"""Which draft head a `--draft` spec names, without torch (the daemon's config check and the planner run
where torch may be missing).

A head spec is `head:NAME` (one trained into `$FLOWEDGE_HOME/draft_heads/NAME.safetensors` by `flowedge
draft-head train`, else a head shipped with flowedge, `flowedge/data/draft_heads/NAME.safetensors`) or a path
to a head file (`*.safetensors`). Anything else is a draft model (models/resolve.py).
"""
from __future__ import annotations

from pathlib import Path

from flowedge.errors import ModelError
from flowedge.home import flowedge_home

HEAD_PREFIX = "head:"
SUFFIX = ".safetensors"
SHIPPED_DIR = Path(__file__).resolve().parents[1] / "data" / "draft_heads"
# heads that ship inside the package: their sha256, pinned here as well as in their sidecars
# (none yet: the one self-distilled within 40 minutes on the dev box accepts 1.1 tokens a check and loses
# to `ar`, docs/draft-head.md; a head ships once one pays)
SHIPPED_SHA256: dict[str, str] = {}


def sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def is_head_spec(spec: str | None) -> bool:
    return spec is not None and (spec.startswith(HEAD_PREFIX) or spec.endswith(SUFFIX))


def resolve_head(spec: str, home: Path | None = None) -> Path:
    """The head file a spec names (see the module docstring); ModelError when there is none."""
    if not spec.startswith(HEAD_PREFIX):
        path = Path(spec).expanduser()
        if not path.is_file():
            raise ModelError(f"no draft head file at {path}")
        return path
    name = spec[len(HEAD_PREFIX):]
    candidates = [trained_path(name, home), SHIPPED_DIR / f"{name}{SUFFIX}"]   # one you trained comes first
    for path in candidates:
        if path.is_file():
            return path
    raise ModelError(f"no draft head named {name!r}: looked in {', '.join(str(c.parent) for c in candidates)} "
                     f"(train one with `flowedge draft-head train`)")


def trained_path(name: str, home: Path | None = None) -> Path:
    """Where `flowedge draft-head train --name NAME` puts its head."""
    return Path(home or flowedge_home()) / "draft_heads" / f"{name}{SUFFIX}"

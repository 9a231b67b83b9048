"""The cache root every part of flowedge keeps its files under (models, shards, keys, built kernels, run
state). One resolver at the bottom of the package, so the kernels, the models and the daemon agree."""
from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "FLOWEDGE_HOME"


def flowedge_home() -> Path:
    """Cache root: $FLOWEDGE_HOME (`~` expanded; empty counts as unset), else ~/.cache/flowedge."""
    env = os.environ.get(HOME_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "flowedge"

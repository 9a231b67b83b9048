"""Torch threads per process: every entry point (the CLI's one-process commands, each node process) sets
them once, before any model work. Here, at the bottom, so none of them imports another to share it."""
from __future__ import annotations

import os


def set_threads(threads: int | None) -> None:
    """Torch's intra-op threads: `threads`, or every core. Several torch processes on one box must each
    be given a share (default threads in each collapse throughput: design notes, two cores)."""
    import torch

    torch.set_num_threads(threads or max(1, os.cpu_count() or 1))

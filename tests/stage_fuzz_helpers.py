"""Random data-plane messages for a stage, and a per-message time bound, shared by the fuzz tests."""
from __future__ import annotations

import random
import signal
from contextlib import contextmanager

import torch

from flowedge.errors import ProtocolError
from flowedge.transport import protocol as p

KINDS = p.SEGMENT_KINDS


class Hung(Exception):
    """A message took longer than its time bound."""


@contextmanager
def time_bound(seconds: float):
    """Raise Hung in this (main) thread if the block runs longer than `seconds`."""
    def _alarm(signum, frame):
        raise Hung(f"no return within {seconds} s")

    old = signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _ids(rng: random.Random, n: int, top: int) -> torch.Tensor:
    return torch.tensor([rng.randrange(top) for _ in range(n)], dtype=torch.long)


def random_message(rng: random.Random, hidden_size: int) -> p.Message | None:
    """A Segment, Prune or Reset with random, often bogus content; None if the constructor refused it.

    Ids, versions and positions are drawn from small ranges so random messages meet the stage's real
    state (the running request, its round, its prune version) often, as a confused or hostile peer's
    would; widths, kinds and dtypes are sometimes wrong."""
    pick = rng.random()
    try:
        if pick < 0.1:
            return p.Reset(run_id=rng.randrange(3))
        if pick < 0.4:
            commit, keep = _ids(rng, rng.randrange(4), 12), _ids(rng, rng.randrange(5), 12)
            if rng.random() < 0.6:
                keep = keep.unique()
            return p.Prune(run_id=rng.randrange(3), round_id=rng.randrange(3), version=rng.randrange(5),
                           horizon=rng.randrange(14), commit_ids=commit, keep_ids=keep,
                           end_round=rng.random() < 0.3)
        n = rng.randrange(7)
        kind = "prefill" if rng.random() < 0.3 else rng.choice(KINDS)
        width = hidden_size if rng.random() < 0.85 else rng.choice([1, hidden_size - 1, hidden_size + 1])
        wire = "float16" if rng.random() < 0.9 else rng.choice(["bfloat16", "float32"])
        start = rng.randrange(40)
        positions = torch.arange(start, start + n) if rng.random() < 0.6 else _ids(rng, n, 60)
        hidden = torch.randn(n, width).to(p.WIRE_DTYPES[wire])
        sampling = dict(temperature=rng.choice([0.0, 0.7, 1.0]), top_k=rng.randrange(5),
                        seed=rng.randrange(100)) if rng.random() < 0.2 else {}
        ids = 0 if kind == "prefill" and rng.random() < 0.9 else n   # a prefill names no nodes (mostly)
        roots = sorted(rng.sample(range(ids), rng.randrange(min(ids, 2) + 1))) if rng.random() < 0.7 else None
        return p.Segment(run_id=rng.randrange(3), round_id=rng.randrange(3), seq=rng.randrange(50),
                         prune_version=rng.randrange(5), kind=kind, sent_at_step=0, node_ids=_ids(rng, ids, 12),
                         parent_ids=_ids(rng, ids, 12), positions=positions, hidden=hidden, hidden_wire=wire,
                         root_rows=None if roots is None else torch.tensor(roots, dtype=torch.long), **sampling)
    except ProtocolError:
        return None


def decode_valid(msg: p.Message) -> p.Message:
    """The message as a stage would receive it: encoded and decoded again."""
    return p.decode([bytes(memoryview(f)) for f in p.encode(msg)])

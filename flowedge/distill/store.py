"""The training set on disk: one file per token sequence with the base model's features and top-k choices.

A record holds `tokens` [T] int64, `features` [T, H] float16 (the base's normalised final hidden state at
each position: what its lm_head reads, and what the head learns to predict), and the base's top-k next
tokens at each position, `top_ids` [T, k] int64 with `top_logp` [T, k] float16 (its log-probabilities over
the whole vocabulary; top_ids[:, 0] is its argmax). Records are written atomically and named by kind and
number, so an interrupted extraction resumes where it stopped.
"""
from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from flowedge.errors import ConfigError

log = logging.getLogger(__name__)

KINDS = ("text", "answer")


@dataclass(frozen=True, slots=True)
class Record:
    tokens: torch.Tensor      # [T] int64
    features: torch.Tensor    # [T, H] float16
    top_ids: torch.Tensor     # [T, k] int64
    top_logp: torch.Tensor    # [T, k] float16

    def __len__(self) -> int:
        return int(self.tokens.numel())


class FeatureStore:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, kind: str, i: int) -> Path:
        if kind not in KINDS:
            raise ConfigError(f"record kind must be one of {KINDS}, got {kind!r}")
        return self.root / f"{kind}-{i:05d}.pt"

    def has(self, kind: str, i: int) -> bool:
        return self.path(kind, i).is_file()

    def put(self, kind: str, i: int, rec: Record) -> None:
        path = self.path(kind, i)
        tmp = path.with_name(path.name + ".tmp")
        torch.save({"tokens": rec.tokens, "features": rec.features, "top_ids": rec.top_ids,
                    "top_logp": rec.top_logp}, tmp)
        tmp.replace(path)

    def get(self, path: Path) -> Record:
        raw = torch.load(path, weights_only=True)
        return Record(raw["tokens"], raw["features"], raw["top_ids"], raw["top_logp"])

    def paths(self, kind: str | None = None) -> list[Path]:
        kinds = KINDS if kind is None else (kind,)
        return sorted(p for k in kinds for p in self.root.glob(f"{k}-*.pt"))

    def tokens(self) -> int:
        return sum(len(self.get(p)) for p in self.paths())


def choose_vocab(store: FeatureStore, paths: list[Path], size: int, vocab_size: int,
                 always: set[int]) -> torch.Tensor:
    """The draft vocabulary: `always` (stop tokens), then the tokens most frequent in the training records
    (as inputs and as the base's choices), then, to fill `size`, the lowest ids not yet in (a BPE
    vocabulary numbers its merges in the order it learnt them: frequent pieces first). Sorted ids."""
    size = min(size, vocab_size)
    counts: Counter[int] = Counter()
    for p in paths:
        rec = store.get(p)
        counts.update(rec.tokens.tolist())
        counts.update(rec.top_ids[:, 0].tolist())
    chosen = [t for t in sorted(always) if t < vocab_size][:size]
    seen = set(chosen)
    for tok, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(chosen) >= size:
            break
        if tok not in seen:
            chosen.append(tok)
            seen.add(tok)
    fill = (t for t in range(vocab_size) if t not in seen)
    chosen += [next(fill) for _ in range(size - len(chosen))]
    log.info("draft vocabulary: %d tokens, %d seen in training (%d distinct there)", size,
             min(size, len(counts)), len(counts))
    return torch.tensor(sorted(chosen), dtype=torch.long)

"""Which nodes of the drafter's stored tree the draft model has run, and where each one's K/V sits in its
cache: an explicit `ran` mask beside the slot numbers (no "-1 = not run" sentinel to test against)."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class CacheSlots:
    slot: torch.Tensor   # [n] int64: the node's cache entry, meaningful only where `ran`
    ran: torch.Tensor    # [n] bool: the draft model has run the node (its entry is in the cache)

    @classmethod
    def none_run(cls, n: int = 0) -> "CacheSlots":
        return cls(torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.bool))

    def __len__(self) -> int:
        return int(self.ran.numel())

    def grow(self, n: int) -> None:
        """The tree has `n` nodes now: the new ones have not run."""
        extra = n - len(self)
        if extra > 0:
            self.slot = torch.cat([self.slot, torch.zeros(extra, dtype=torch.long)])
            self.ran = torch.cat([self.ran, torch.zeros(extra, dtype=torch.bool)])

    def put(self, nodes: torch.Tensor | int, slots: torch.Tensor | int) -> None:
        """`nodes` ran; their entries are `slots`."""
        self.slot[nodes] = slots
        self.ran[nodes] = True

    def shift(self, by: int) -> None:
        """Every entry moved `by` places (an entry was put in front of them)."""
        self.slot = torch.where(self.ran, self.slot + by, self.slot)

    def not_run(self) -> torch.Tensor:
        """[m] ids of the nodes never run."""
        return (~self.ran).nonzero().reshape(-1)

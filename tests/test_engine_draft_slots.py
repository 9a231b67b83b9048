"""The drafter's node -> cache-entry map (engine/draft_slots.py): an explicit `ran` mask, no -1 sentinel."""
from __future__ import annotations

import torch

from flowedge.engine.draft_slots import CacheSlots


def test_nodes_run_keep_their_entries_and_new_nodes_start_not_run():
    slots = CacheSlots.none_run(3)
    assert slots.not_run().tolist() == [0, 1, 2]
    slots.put(torch.tensor([1, 2]), torch.tensor([5, 6]))
    slots.grow(5)
    assert len(slots) == 5 and slots.ran.tolist() == [False, True, True, False, False]
    assert slots.not_run().tolist() == [0, 3, 4] and slots.slot[1:3].tolist() == [5, 6]
    slots.put(4, 0)   # entry 0 is a real entry, not "none"
    assert bool(slots.ran[4]) and int(slots.slot[4]) == 0


def test_a_shift_moves_only_the_entries_of_nodes_run():
    slots = CacheSlots.none_run(3)
    slots.put(2, 7)
    slots.shift(1)
    assert slots.slot[slots.ran].tolist() == [8] and slots.ran.tolist() == [False, False, True]
    slots.grow(2)   # never shrinks
    assert len(slots) == 3

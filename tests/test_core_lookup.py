"""Prompt lookup: the continuation after the latest earlier occurrence of the longest matching suffix."""
import torch

from flowedge.core.lookup import lookup_continuation


def t(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.long)


def test_the_latest_occurrence_of_the_longest_suffix_wins():
    # suffix (7, 8) occurs twice; the later occurrence is followed by 4, 5
    assert lookup_continuation(t(7, 8, 1, 2, 7, 8, 4, 5, 9, 7, 8), 2).tolist() == [4, 5]
    # a 3-gram match beats a later 1-gram one
    assert lookup_continuation(t(1, 2, 3, 6, 9, 3, 5, 1, 2, 3), 1).tolist() == [6]


def test_continuation_is_capped_and_may_run_into_the_suffix_itself():
    assert lookup_continuation(t(1, 2, 3, 4, 5, 6, 1, 2), 3).tolist() == [3, 4, 5]
    assert lookup_continuation(t(1, 1, 1, 1), 5).tolist() == [1]


def test_nothing_to_guess_gives_an_empty_tensor():
    assert lookup_continuation(t(1, 2, 3), 4).numel() == 0
    assert lookup_continuation(t(9), 4).numel() == 0
    assert lookup_continuation(t(1, 2, 1, 2), 0).numel() == 0

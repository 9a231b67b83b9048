"""`flowedge generate`'s result: decode speed apart from prefill, on the tiny pair and on hand-made results."""
from __future__ import annotations

import pytest

from flowedge.core.sampling import SamplingParams
from flowedge.engine.local import GenerationResult, generate_ar_staged
from flowedge.models.stage import StageModel
from flowedge.generate import decode_stats


def test_decode_rate_counts_the_tokens_after_the_first_over_the_time_after_the_first():
    res = GenerationResult(token_ids=list(range(11)), wall_s=3.0, first_token_s=1.0)
    stats = decode_stats(res)
    assert stats == {"prefill_s": 1.0, "decode_s": 2.0, "decode_tokens_per_s": 5.0}


def test_no_decode_rate_for_a_single_token_or_without_a_first_token_time():
    assert decode_stats(GenerationResult([7], wall_s=0.5, first_token_s=0.5))["decode_tokens_per_s"] is None
    assert decode_stats(GenerationResult([7, 8], wall_s=0.5)) == {}


def test_staged_ar_times_its_first_token_inside_its_wall_time(tiny_pair):
    base, _ = tiny_pair
    res = generate_ar_staged(StageModel.load(base), [1, 2, 3], 6, SamplingParams())
    assert res.first_token_s is not None and 0 < res.first_token_s <= res.wall_s
    assert res.decode_s == pytest.approx(res.wall_s - res.first_token_s)

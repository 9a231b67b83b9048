"""SamplingParams validation and warp_probs semantics (hand cases, and Hugging Face's warpers)."""
from __future__ import annotations

import math

import pytest
import torch

from flowedge.core.sampling import SamplingParams, choose_token, make_generator, warp_probs
from flowedge.errors import ConfigError

torch.set_num_threads(1)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(temperature=-0.1),
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(top_k=-1),
        dict(top_k=2.5),
        dict(top_p=0.0),
        dict(top_p=1.5),
        dict(top_p=float("nan")),
        dict(seed="7"),
    ],
)
def test_params_reject(kwargs) -> None:
    with pytest.raises(ConfigError):
        SamplingParams(**kwargs)


def test_params_defaults_and_greedy() -> None:
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.5).greedy
    with pytest.raises(AttributeError):
        SamplingParams().temperature = 1.0  # frozen


def test_warp_temperature_only_is_softmax() -> None:
    logits = torch.tensor([1.0, 2.0, 0.5, -1.0])
    probs = warp_probs(logits, SamplingParams(temperature=0.5))
    assert probs.dtype == torch.float32
    assert torch.allclose(probs, torch.softmax(logits / 0.5, -1))


def test_warp_top_k_keeps_ties() -> None:
    logits = torch.tensor([3.0, 1.0, 1.0, 0.0, 2.0])
    probs = warp_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    assert (probs > 0).tolist() == [True, True, True, False, True]  # 1.0 ties with the 3rd value
    probs2 = warp_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (probs2 > 0).tolist() == [True, False, False, False, True]
    assert math.isclose(float(probs2.sum()), 1.0, rel_tol=1e-6)


def test_warp_top_p_smallest_set_reaching_mass() -> None:
    probs_in = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs_in.log()
    kept = lambda p: (warp_probs(logits, SamplingParams(temperature=1.0, top_p=p)) > 0).tolist()
    assert kept(0.5) == [True, False, False, False]
    assert kept(0.6) == [True, True, False, False]
    assert kept(0.9) == [True, True, True, False]
    assert kept(0.01) == [True, False, False, False]  # always at least one
    out = warp_probs(logits, SamplingParams(temperature=1.0, top_p=0.9))
    assert torch.allclose(out, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95, atol=1e-6)


def test_warp_greedy_one_hot_first_max() -> None:
    probs = warp_probs(torch.tensor([[1.0, 3.0, 3.0], [5.0, 0.0, 0.0]]), SamplingParams())
    assert probs.tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_warp_batched_rows_independent() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 20, generator=gen)
    params = SamplingParams(temperature=0.8, top_k=7, top_p=0.8)
    batched = warp_probs(logits, params)
    for i in range(3):
        for j in range(4):
            assert torch.allclose(batched[i, j], warp_probs(logits[i, j], params))


def test_warp_matches_huggingface() -> None:
    lp = pytest.importorskip("transformers.generation.logits_process")
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 50, generator=gen) * 3
    for temperature, top_k, top_p in [(1.0, 0, 1.0), (0.7, 10, 0.9), (1.3, 5, 1.0), (0.5, 0, 0.6), (1.0, 50, 0.3)]:
        scores = lp.TemperatureLogitsWarper(temperature)(None, logits.clone())
        if top_k:
            scores = lp.TopKLogitsWarper(top_k)(None, scores)
        if top_p < 1.0:
            scores = lp.TopPLogitsWarper(top_p)(None, scores)
        expect = torch.softmax(scores, -1)
        got = warp_probs(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
        assert torch.equal(got > 0, expect > 0)
        assert torch.allclose(got, expect, atol=1e-6)


def test_choose_token_greedy_first_max() -> None:
    assert choose_token(torch.tensor([0.0, 2.0, 2.0, 1.0]), SamplingParams(), None) == 1


def test_choose_token_seeded_reproducible_and_respects_filter() -> None:
    params = SamplingParams(temperature=1.0, top_k=2, seed=11)
    logits = torch.tensor([0.0, 1.0, 0.9, 0.2, 0.1])
    g1, g2 = make_generator(params), make_generator(params)
    draws1 = [choose_token(logits, params, g1) for _ in range(200)]
    draws2 = [choose_token(logits, params, g2) for _ in range(200)]
    assert draws1 == draws2
    assert set(draws1) == {1, 2}


def test_choose_token_rejects_batched() -> None:
    with pytest.raises(ValueError):
        choose_token(torch.zeros(2, 3), SamplingParams(), None)


def test_make_generator() -> None:
    assert make_generator(SamplingParams()) is None
    unseeded = make_generator(SamplingParams(temperature=1.0))
    assert isinstance(unseeded, torch.Generator)
    seeded = make_generator(SamplingParams(temperature=1.0, seed=5))
    assert seeded.initial_seed() == 5


def test_a_vanishing_temperature_draws_the_argmax_without_overflow() -> None:
    """logits / 1e-40 overflow float32 (inf - inf is NaN in the softmax); the same distribution from the
    logits shifted to their maximum is the one-hot on the argmax (ties share it)."""
    logits = torch.tensor([0.5, 3.0, -2.0, 3.0 - 1e-3])
    probs = warp_probs(logits, SamplingParams(temperature=1e-40, seed=1))
    assert torch.equal(probs, torch.tensor([0.0, 1.0, 0.0, 0.0]))
    tied = warp_probs(torch.tensor([1.0, 1.0, 0.0]), SamplingParams(temperature=1e-40, seed=1))
    assert torch.equal(tied, torch.tensor([0.5, 0.5, 0.0]))

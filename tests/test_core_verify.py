"""walk: greedy walks on hand-built trees, and chi-square losslessness of sampled walks.

The lossless tests also run a deliberately wrong verifier through the same statistic, to show the test
has the power to catch a biased acceptance rule.
"""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from flowedge.core.sampling import SamplingParams, choose_token, warp_probs
from flowedge.core.tree import DraftTree
from flowedge.core.verify import WalkResult, walk

torch.set_num_threads(1)

DRAWS = 5000  # chi-square power is ample: the wrong verifier scores p < 1e-50
V = 6
ROOT_LOGITS = torch.tensor([1.0, 0.2, 2.0, -0.5, 1.5, 0.0])
CHILD_TOKENS = [2, 4, 0]  # a deterministic top-3 draft below the root
CHILD_LOGITS = {  # base logits at each child (for the two-level test)
    1: torch.tensor([0.5, 0.5, -1.0, 2.0, 0.0, 1.0]),
    2: torch.tensor([-2.0, 1.0, 1.0, 0.0, 0.3, 0.1]),
    3: torch.tensor([0.0, 0.0, 0.0, 3.0, -1.0, 0.7]),
}
SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.7, top_k=4, top_p=0.9),
]


def star_tree() -> DraftTree:
    tree = DraftTree.root_only(5)
    tree.append(torch.tensor(CHILD_TOKENS), torch.tensor([0, 0, 0]), torch.tensor([-0.5, -1.0, -2.0]))
    return tree


def wrong_walk(tree: DraftTree, logits: dict, params: SamplingParams, generator: torch.Generator) -> WalkResult:
    """Biased on purpose: take the draft's first child whenever the base gives it > 10 %."""
    first = int(tree.children(0)[0])
    token = int(tree.tokens[first])
    if float(warp_probs(logits[0], params)[token]) > 0.1:
        return WalkResult([0], [token], first)
    return walk(tree, 0, logits, params, generator)


def first_token_pvalue(draws: list[int], params: SamplingParams) -> float:
    probs = warp_probs(ROOT_LOGITS, params).double()
    counts = torch.bincount(torch.tensor(draws), minlength=V).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "drew a token the warped distribution excludes"
    expected = probs[support] / probs[support].sum() * len(draws)  # float32 sums are 1 within ~1e-7
    return float(chisquare(counts[support].numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("params", SETTINGS)
def test_first_token_is_base_distribution(params: SamplingParams) -> None:
    tree, gen = star_tree(), torch.Generator().manual_seed(1234)
    draws = []
    for _ in range(DRAWS):
        result = walk(tree, 0, {0: ROOT_LOGITS}, params, gen)
        assert result.committed == [0] and len(result.tokens) == 1
        expect_next = 1 + CHILD_TOKENS.index(result.tokens[0]) if result.tokens[0] in CHILD_TOKENS else None
        assert result.next_node == expect_next
        draws.append(result.tokens[0])
    assert first_token_pvalue(draws, params) > 0.001


@pytest.mark.parametrize("params", SETTINGS)
def test_wrong_verifier_fails_same_test(params: SamplingParams) -> None:
    tree, gen = star_tree(), torch.Generator().manual_seed(1234)
    draws = [wrong_walk(tree, {0: ROOT_LOGITS}, params, gen).tokens[0] for _ in range(DRAWS)]
    assert first_token_pvalue(draws, params) < 1e-6


@pytest.mark.parametrize("params", SETTINGS)
def test_two_level_joint_distribution(params: SamplingParams) -> None:
    """With children's logits known the walk emits a second token exactly when the first matched a
    child; the pair must follow p(x0) * p(x1 | x0)."""
    tree, gen = star_tree(), torch.Generator().manual_seed(99)
    logits = {0: ROOT_LOGITS, **CHILD_LOGITS}
    p0 = warp_probs(ROOT_LOGITS, params).double()
    expected: dict[tuple, float] = {}
    for x0 in range(V):
        if x0 in CHILD_TOKENS:
            p1 = warp_probs(CHILD_LOGITS[1 + CHILD_TOKENS.index(x0)], params).double()
            for x1 in range(V):
                expected[(x0, x1)] = float(p0[x0] * p1[x1])
        else:
            expected[(x0,)] = float(p0[x0])
    counts = dict.fromkeys(expected, 0)
    for _ in range(DRAWS):
        result = walk(tree, 0, logits, params, gen)
        assert result.next_node is None  # children are leaves
        counts[tuple(result.tokens)] += 1
    keys = [k for k, p in expected.items() if p > 0]
    assert all(counts[k] == 0 for k, p in expected.items() if p == 0)
    observed = [counts[k] for k in keys]
    exp = [expected[k] * DRAWS for k in keys]
    scale = sum(observed) / sum(exp)  # float32 probabilities sum to 1 within ~1e-7
    assert chisquare(observed, [e * scale for e in exp]).pvalue > 0.001


def chain_tree() -> DraftTree:
    # 0(10) -> 1(11) -> 2(12) -> 3(13);  0 -> 4(21);  1 -> 5(22)
    tree = DraftTree.root_only(10)
    tree.append(torch.tensor([11, 12, 13, 21, 22]), torch.tensor([0, 1, 2, 0, 1]),
                torch.tensor([-0.1, -0.2, -0.3, -1.0, -2.0]))
    return tree


def onehot(token: int, vocab: int = 30) -> torch.Tensor:
    out = torch.zeros(vocab)
    out[token] = 5.0
    return out


GREEDY = SamplingParams()


def test_greedy_walk_accepts_chain_and_stops_on_mismatch() -> None:
    tree = chain_tree()
    logits = {0: onehot(11), 1: onehot(12), 2: onehot(7), 3: onehot(1)}
    result = walk(tree, 0, logits, GREEDY, None)
    assert result.committed == [0, 1, 2]
    assert result.tokens == [11, 12, 7]
    assert result.next_node is None and not result.continues


def test_greedy_walk_stops_at_unknown_logits_with_next_node() -> None:
    tree = chain_tree()
    result = walk(tree, 0, {0: onehot(11), 1: onehot(22)}, GREEDY, None)
    assert result.committed == [0, 1] and result.tokens == [11, 22]
    assert result.next_node == 5 and result.continues


def test_walk_from_inner_start_and_callable_source() -> None:
    tree = chain_tree()
    table = {1: onehot(12), 2: onehot(13)}
    result = walk(tree, 1, table.get, GREEDY, None)
    assert result.committed == [1, 2] and result.tokens == [12, 13] and result.next_node == 3


def test_walk_skips_dead_children() -> None:
    tree = chain_tree()
    alive = torch.ones(len(tree), dtype=torch.bool)
    alive[1] = False
    result = walk(tree, 0, {0: onehot(11), 1: onehot(12)}, GREEDY, None, alive)
    assert result.committed == [0] and result.tokens == [11] and result.next_node is None


def test_walk_prefers_first_of_duplicate_children() -> None:
    tree = DraftTree.root_only(0)
    tree.append(torch.tensor([3, 3]), torch.tensor([0, 0]), torch.tensor([-1.0, -1.0]))
    assert walk(tree, 0, {0: onehot(3)}, GREEDY, None).next_node == 1


def test_walk_unknown_start_raises() -> None:
    with pytest.raises(ValueError):
        walk(chain_tree(), 0, {1: onehot(1)}, GREEDY, None)
    with pytest.raises(ValueError):
        walk(chain_tree(), 9, {9: onehot(1)}, GREEDY, None)
    with pytest.raises(ValueError):
        walk(chain_tree(), 0, {0: onehot(1)}, GREEDY, None, torch.ones(3, dtype=torch.bool))


def test_walk_greedy_equals_choose_token() -> None:
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(30, generator=gen)
    result = walk(chain_tree(), 3, {3: logits}, GREEDY, None)
    assert result.tokens == [choose_token(logits, GREEDY, None)] == [int(logits.argmax())]


def test_walk_seeded_matches_autoregressive_draws() -> None:
    """One generator draw per emitted token: a seeded walk reproduces plain decoding token for token."""
    params = SamplingParams(temperature=1.0, seed=3)
    tree = chain_tree()
    logits = {0: onehot(11) * 0.3, 1: onehot(12) * 0.3, 2: onehot(13) * 0.3, 3: onehot(4) * 0.3}
    for seed in range(20):
        walked = walk(tree, 0, logits, params, torch.Generator().manual_seed(seed))
        gen = torch.Generator().manual_seed(seed)
        plain = [choose_token(logits[node], params, gen) for node in walked.committed]
        assert walked.tokens == plain


def test_walk_result_validation() -> None:
    with pytest.raises(ValueError):
        WalkResult([], [], None)
    with pytest.raises(ValueError):
        WalkResult([0, 1], [5], None)

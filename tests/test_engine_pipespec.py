"""Strategy `pipespec`: prompt lookup -> draft chain -> pipelined base; rollback keeps it lossless."""
from __future__ import annotations

import collections

import torch
from scipy.stats import chi2_contingency

from flowedge.core.sampling import SamplingParams
from flowedge.engine.drafter import Drafter, TreeShape
from flowedge.models.stage import StageModel
from flowedge.sim.run import Cluster
from tests.test_engine_strategies import PROMPTS, SMALL


def test_a_chain_call_adopts_the_lookup_guess_the_draft_agrees_with(tiny_pair, monkeypatch):
    _, draft = tiny_pair
    drafter = Drafter(StageModel.load(draft))
    context = list(range(3, 12))
    chain = drafter.build(context, TreeShape(topk=1, depth=1, keep_all=False))
    for _ in range(6):
        drafter.extend_chain(0)
    greedy = chain.tokens[1:].tolist()            # the draft's own continuation, one call per token
    # A lookup that guesses that continuation right (3 tokens) and then wrong: one call adds the tip's
    # child, adopts the 3 guessed tokens the draft agrees with, and stops at the wrong one.
    guess = greedy[1:4] + [(greedy[4] + 1) % 256]
    monkeypatch.setattr("flowedge.engine.drafter.lookup_continuation", lambda seq, n: torch.tensor(guess[:n]))
    chain = drafter.build(context, TreeShape(topk=1, depth=1, keep_all=False))
    calls = drafter.forwards
    new = drafter.extend_chain(lookup=4)
    assert drafter.forwards == calls + 1
    assert chain.tokens[1:].tolist() == greedy[:5] and new.numel() == 4
    assert bool((chain.parents[1:] == torch.arange(len(chain) - 1)).all())   # still one chain


def test_rollbacks_keep_the_sampling_distribution(tiny_pair):
    """Two-sample test: the 6th token under pipespec against plain ar-pp, 300 seeds each."""
    base, draft = tiny_pair
    cluster = Cluster(base, draft, 3, SMALL)
    counts = {"pipespec": collections.Counter(), "ar-pp": collections.Counter()}
    rounds = 0
    for seed in range(300):
        for name, offset in (("pipespec", 0), ("ar-pp", 10_000)):
            res, _, _ = cluster.generate(name, PROMPTS[2], 6, SamplingParams(temperature=1.0, seed=seed + offset))
            if len(res.done.token_ids) == 6:
                counts[name][res.done.token_ids[5]] += 1
            if name == "pipespec":
                rounds += res.done.stats.rounds
    assert rounds > 300   # rejections rolled chains back
    top = [t for t, _ in (counts["pipespec"] + counts["ar-pp"]).most_common(5)]
    table = [[c[t] for t in top] + [sum(c.values()) - sum(c[t] for t in top)] for c in counts.values()]
    assert chi2_contingency(table).pvalue > 1e-3

"""`bench --draft oracle`: the reference answer as top-1 proposals, at the real draft's cost, lossless."""
from __future__ import annotations

from flowedge.core.sampling import SamplingParams
from flowedge.engine.local import generate_ar
from flowedge.sim.oracle_draft import OracleDraft
from flowedge.sim.run import Cluster
from tests.test_engine_strategies import PROMPTS, SMALL


def test_oracle_draft_accepts_more_at_the_same_draft_cost_and_stays_lossless(tiny_pair):
    base, draft = tiny_pair
    cluster = Cluster(base, draft, 3, SMALL)
    real = cluster.draft_model
    for prompt in PROMPTS:
        ref = generate_ar(base, prompt, 24, SamplingParams()).token_ids
        res_real, _, _ = cluster.generate("flowspec", prompt, 24, SamplingParams())
        cluster.draft_model = OracleDraft(real)
        cluster.draft_model.set_reference(prompt, ref)
        try:
            res, head, _ = cluster.generate("flowspec", prompt, 24, SamplingParams())
            pipedec, _, _ = cluster.generate("pipedec", prompt, 24, SamplingParams())
        finally:
            cluster.draft_model = real
        assert res.done.token_ids == ref and pipedec.done.token_ids == ref
        stats = res.done.stats
        assert sum(stats.accept_lens) / len(stats.accept_lens) >= \
            sum(res_real.done.stats.accept_lens) / len(res_real.done.stats.accept_lens)

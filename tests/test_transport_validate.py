"""Boundary checks of data-plane messages, bounded error texts, and plain file names."""
from __future__ import annotations

import msgpack
import pytest
import torch

from flowedge.errors import ProtocolError
from flowedge.filenames import is_plain_file_name
from flowedge.transport import protocol as p
from flowedge.transport.validate import (
    InvalidMessage,
    ReturnPlan,
    StagePlan,
    check_prune,
    check_returned_segment,
    check_stage_input,
)

PLAN = StagePlan(hidden_size=8, hidden_wire="float16", max_positions=512)


def _seg(node_ids, parent_ids, *, kind="draft", width=8, positions=None, roots=None, **kw) -> p.Segment:
    n = len(node_ids) if positions is None else len(positions)
    if kind == "prefill":
        node_ids = parent_ids = []
    return p.Segment(run_id=1, round_id=0, seq=1, prune_version=0, kind=kind, sent_at_step=1,
                     node_ids=torch.tensor(node_ids, dtype=torch.long),
                     parent_ids=torch.tensor(parent_ids, dtype=torch.long),
                     root_rows=None if roots is None else torch.tensor(roots, dtype=torch.long),
                     positions=(torch.arange(10, 10 + n) if positions is None
                                else torch.tensor(positions, dtype=torch.long)),
                     hidden=torch.zeros(n, width, dtype=torch.float16), **kw)


def _prune(commit, keep, horizon=10) -> p.Prune:
    return p.Prune(run_id=1, round_id=0, version=1, horizon=horizon,
                   commit_ids=torch.tensor(commit, dtype=torch.long), keep_ids=torch.tensor(keep, dtype=torch.long))


def _rule(msg, plan=PLAN) -> str:
    with pytest.raises(InvalidMessage) as err:
        check_stage_input(msg, plan)
    assert isinstance(err.value, ProtocolError)
    return err.value.rule


# ---- the defects found from outside, one regression test each ------------------------------------
def test_a_5kb_type_becomes_a_short_error_and_the_replies_quoting_it_can_be_built():
    frames = [msgpack.packb({"v": [1, 2], "type": "x" * 5000, "tensors": {}})]
    with pytest.raises(ProtocolError) as err:
        p.decode(frames)
    assert len(str(err.value)) < 200
    reply = p.ErrorReply(request_id=0, message=f"malformed message: {err.value}")
    refuse = p.Refuse(reason="y" * 5000)   # even a reply quoting raw peer text is cut, never refused
    assert len(refuse.reason) == p.MAX_TEXT_CHARS and refuse.reason.endswith("…")
    for msg in (reply, refuse, p.Shutdown(reason="z" * 10_000)):
        assert p.decode(p.encode(msg)) == msg


def test_overlapping_prune_sets_are_refused():
    assert _rule(_prune([1, 2], [2, 3])) == "prune_overlap"


def test_a_node_that_is_its_own_parent_is_refused():
    assert _rule(_seg([5], [5])) == "segment_parents"
    assert _rule(_seg([3, 4], [4, 3])) == "segment_parents"   # a two-node cycle
    assert _rule(_seg([0, 4], [4, 0], roots=[1])) == "segment_parents"   # a root row names no parent


def test_hidden_states_of_the_wrong_width_are_refused():
    assert _rule(_seg([1], [0], width=9)) == "segment_width"


# ---- the other rules -------------------------------------------------------------------------------
def test_a_well_formed_tree_segment_and_prefill_pass():
    check_stage_input(_seg([1, 2, 3], [0, 1, 1]), PLAN)
    check_stage_input(_seg([0, 1, 2], [0, 0, 1], roots=[0]), PLAN)   # node 0 hangs off the committed context
    check_stage_input(_seg([], [], kind="prefill", positions=[0, 1]), PLAN)
    check_stage_input(_seg([], [], positions=[]), PLAN)
    check_stage_input(_prune([0, 4], [5, 7]), PLAN)
    check_stage_input(p.Reset(run_id=3), PLAN)


@pytest.mark.parametrize("msg, rule", [
    (_seg([1, 1], [0, 0]), "segment_ids"),
    (_seg([0], [0]), "segment_parents"),            # node 0 as its own parent: a root must say so (root_rows)
    (_seg([70_000], [0]), "segment_ids"),
    (_seg([1], [0], positions=[600]), "segment_positions"),
    (_seg([], [], kind="prefill", positions=[]), "prefill_empty"),
    (_seg([], [], kind="prefill", positions=[0, 2]), "prefill_positions"),
    (_seg([1], [0], hidden_wire="bfloat16"), "segment_dtype"),
    (_seg([1], [0], temperature=1000.0), "segment_sampling"),
    (_prune([1], [3, 2]), "prune_order"),
    (_prune([1, 1], []), "prune_repeat"),
    (_prune([12], [], horizon=10), "prune_range"),
    (_prune([], [], horizon=1 << 20), "prune_horizon"),
    (p.Hello(node_id="x", role="stage", device="cpu", free_memory_bytes=1), "unexpected_type"),
])
def test_each_rule_names_itself(msg, rule):
    assert _rule(msg) == rule


def test_the_tree_fields_are_checked_on_decode():
    """1.4: a prefill chunk carries no tree ids; root rows are ascending rows of the segment; a
    prefill's returned choice is one token."""
    z = torch.zeros(2, dtype=torch.long)
    base = dict(run_id=1, round_id=0, seq=1, prune_version=0, sent_at_step=1, positions=torch.arange(2),
                hidden=torch.zeros(2, 8, dtype=torch.float16))
    with pytest.raises(ProtocolError, match="node_ids"):
        p.Segment(kind="prefill", node_ids=z, parent_ids=z, **base)
    with pytest.raises(ProtocolError, match="root_rows"):
        p.Segment(kind="draft", node_ids=torch.tensor([1, 2]), parent_ids=z, root_rows=torch.tensor([2]), **base)
    with pytest.raises(ProtocolError, match="root_rows"):
        p.Segment(kind="draft", node_ids=torch.tensor([1, 2]), parent_ids=z, root_rows=torch.tensor([1, 0]), **base)
    empty = torch.empty(0, dtype=torch.long)
    choice = dict(base, hidden=None, token_ids=torch.tensor([7]))
    chosen = p.decode(p.encode(p.Segment(kind="prefill", node_ids=empty, parent_ids=empty, **choice)))
    assert chosen.token_ids.tolist() == [7]
    with pytest.raises(ProtocolError, match="token_ids"):
        p.Segment(kind="prefill", node_ids=empty, parent_ids=empty, **dict(choice, token_ids=torch.tensor([7, 8])))


def test_a_segment_from_a_peer_before_1_9_is_refused_with_a_clear_error():
    seg = _seg([0, 1], [0, 0], roots=[0])
    frames = [bytes(memoryview(f)) for f in p.encode(seg)]
    header = msgpack.unpackb(frames[0])
    header["v"] = [1, 3]
    with pytest.raises(ProtocolError, match=r"protocol 1\.3, this node speaks 1\.9.*1\.9 or newer"):
        p.decode([msgpack.packb(header), *frames[1:]])
    assert p.decode(frames) == seg


def test_a_segment_of_token_ids_is_no_stage_input():
    seg = p.Segment(run_id=1, round_id=0, seq=1, prune_version=0, kind="draft", sent_at_step=1,
                    node_ids=torch.tensor([1]), parent_ids=torch.tensor([0]), positions=torch.tensor([3]),
                    token_ids=torch.tensor([5]))
    assert _rule(seg) == "segment_payload"


def test_segment_size_is_bounded():
    plan = StagePlan(hidden_size=8, hidden_wire="float16", max_positions=512, max_segment_nodes=2)
    assert _rule(_seg([1, 2, 3], [0, 1, 2]), plan) == "segment_size"


def test_prune_check_alone_accepts_empty_sets():
    check_prune(_prune([], [], horizon=0))


def test_returned_segments_name_only_nodes_the_head_sent():
    plan = ReturnPlan(hidden_size=8, vocab_size=100)
    check_returned_segment(_seg([0, 1], [0, 0], roots=[0]), plan, known_ids=2)
    check_returned_segment(_seg([], [], kind="prefill", positions=[0, 1]), plan, known_ids=0)
    for seg, rule in ((_seg([2], [0]), "return_ids"), (_seg([1], [0], width=4), "return_width")):
        with pytest.raises(InvalidMessage) as err:
            check_returned_segment(seg, plan, known_ids=2)
        assert err.value.rule == rule
    tokens = p.Segment(run_id=1, round_id=0, seq=1, prune_version=0, kind="draft", sent_at_step=1,
                       node_ids=torch.tensor([1]), parent_ids=torch.tensor([0]), positions=torch.tensor([3]),
                       token_ids=torch.tensor([100]))
    with pytest.raises(InvalidMessage, match="vocabulary"):
        check_returned_segment(tokens, plan, known_ids=2)


@pytest.mark.parametrize("name, ok", [
    ("stage-1.safetensors", True), ("config.json", True), ("../x", False), ("/etc/passwd", False),
    ("a/b", False), ("a\\b", False), (".hidden", False), ("..", False), ("", False), ("a\0b", False),
    ("x" * 300, False), (3, False),
])
def test_plain_file_names(name, ok):
    assert is_plain_file_name(name) is ok


def test_assign_refuses_side_files_that_leave_the_directory():
    sha = "0" * 64
    for name in ("../config.json", "/tmp/x", "a\\b", ""):
        with pytest.raises(ProtocolError, match="side_files"):
            p.Assign(stage_index=1, layer_start=0, layer_end=1, shard_sha256=sha, shard_bytes=1, next_addr="",
                     model="m", side_files={name: "{}"})


@pytest.mark.parametrize("evil", ["../../escaped.safetensors", "/tmp/escaped.safetensors", "sub/x", ".x"])
def test_a_manifest_naming_a_file_outside_the_cache_is_refused(tmp_path, evil):
    """A head (holding the keys) sends a manifest whose stage file would land outside the stage's cache:
    the fetch is refused before a byte is requested, and nothing is written outside the cache."""
    import json

    from flowedge.node import shard_fetch
    from flowedge.errors import ModelError
    from flowedge.models.shards import Manifest

    sha = "a" * 64
    manifest = {"format": 1, "model": "m", "num_layers": 1, "hidden_size": 4, "dtype": "float32", "tied": True,
                "head": {"file": "head.safetensors", "sha256": "0" * 64, "bytes": 1},
                "stages": [{"index": 0, "layers": [0, 1], "file": evil, "sha256": sha, "bytes": 10}]}
    assign = p.Assign(stage_index=1, layer_start=0, layer_end=1, shard_sha256=sha, shard_bytes=10, next_addr="",
                      model="m", side_files={"manifest.json": json.dumps(manifest)})
    home = tmp_path / "a" / "b" / "home"
    asked: list = []
    with pytest.raises(ProtocolError, match="plain file names"):
        shard_fetch.fetch(assign, home, asked.append, lambda timeout: None)
    assert asked == [] and not (tmp_path / "a" / "escaped.safetensors").exists()
    assert shard_fetch.cached_shas(home) == []
    (tmp_path / "split").mkdir()
    (tmp_path / "split" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ModelError, match="plain file names"):
        Manifest.load(tmp_path / "split")


def test_the_engine_never_builds_a_segment_a_stage_would_drop():
    from flowedge.core.config import SpecConfig
    from flowedge.errors import ConfigError
    from flowedge.transport.validate import MAX_SEGMENT_NODES

    SpecConfig(prefill_chunk=MAX_SEGMENT_NODES)
    with pytest.raises(ConfigError, match="prefill-chunk must be <= 4096"):
        SpecConfig(prefill_chunk=MAX_SEGMENT_NODES + 1)

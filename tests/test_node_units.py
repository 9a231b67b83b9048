"""Node pieces without processes: node config files, the engine <-> wire adapter."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowedge.core.prune import PruneSet
from flowedge.engine import events
from flowedge.errors import ConfigError, ProtocolError
from flowedge.launch.config_file import load_node_config
from flowedge.node import wire
from flowedge.node.node_config import NodeConfig
from flowedge.transport import protocol as proto
from flowedge.transport.addresses import split_addr

EXAMPLE = Path(__file__).resolve().parents[1] / "flowedge" / "data" / "flowedge.toml.example"


def test_example_config_parses_and_overrides_apply():
    cfg = load_node_config(EXAMPLE)
    assert cfg.role == "head" and cfg.stages == 4 and cfg.quant == "int4"
    stage = load_node_config(EXAMPLE, role="stage", head="10.0.0.2:6000", threads=2)
    assert (stage.role, split_addr(stage.head), stage.threads) == ("stage", ("10.0.0.2", 6000), 2)


@pytest.mark.parametrize("text, match", [
    ('rol = "head"\n', r"f\.toml: unknown key 'rol' \(did you mean 'role'\?\)$"),
    ('[flowedge]\nheartbeat = 100\n', r"f\.toml: unknown key 'heartbeat' \(did you mean 'heartbeat_ms'\?\)$"),
    ('role = "boss"\n', r"f\.toml: role must be one of 'head', 'stage', 'drafter' or 'standby'; got 'boss'$"),
    ('wire_dtype = "int8"\n', "f\\.toml: wire_dtype must be one of"),
    ('stages = "2"\n', r"f\.toml: stages should be a valid integer; got '2'$"),
    ('stages = 0\n', r"f\.toml: stages must be >= 1; got 0$"),
    ('insecure = 1\n', r"f\.toml: insecure should be a valid boolean; got 1$"),
    ('client_weights = {x = 0}\n', r"f\.toml: client_weights\.x must be > 0\.0; got 0$"),
    ('layers = [3, "4"]\n', r"f\.toml: layers\.1 should be a valid integer"),
    ('head = "nohost"\n', "f\\.toml: .*HOST:PORT"),
    ('stages = 2\nlayers = [1, 2, 3]\n', "f\\.toml: layers lists 3 stages"),
    ('draft_quant = "fp8"\n', "draft_quant must be one of"),
    ('lookup_tokens = -1\n', "lookup_tokens must be >= 0"),
    ('tree_size = "huge"\n', "tree_size must be one of"),
    ('role = \n', "not valid TOML"),
])
def test_bad_config_files_are_one_line_errors(tmp_path, text, match):
    path = tmp_path / "f.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=match) as got:
        load_node_config(path)
    assert "\n" not in str(got.value) and str(path) in str(got.value)


def test_the_file_model_has_every_node_config_key_and_its_defaults():
    """NodeFile lists NodeConfig's keys by hand (types and ranges); a key added to one only fails here."""
    from dataclasses import fields

    from flowedge.launch.config_file import NodeFile

    assert list(NodeFile.model_fields) == [f.name for f in fields(NodeConfig)]
    assert NodeConfig(**NodeFile().model_dump()) == NodeConfig()


def test_command_line_overrides_still_pass_the_node_config_checks(tmp_path):
    path = tmp_path / "f.toml"
    path.write_text('role = "stage"\n')
    with pytest.raises(ConfigError, match="f\\.toml with the command line: stages must be >= 1"):
        load_node_config(path, stages=0)
    assert load_node_config(path, threads=None).role == "stage"   # None: not given


def test_missing_config_file_names_the_example(tmp_path):
    with pytest.raises(ConfigError, match="flowedge.toml.example"):
        load_node_config(tmp_path / "absent.toml")


@pytest.mark.parametrize("wire_dtype", ["float32", "float16"])
def test_segment_survives_the_wire(wire_dtype):
    seg = events.Segment(3, 2, 7, 5, torch.tensor([0, 4, 5, 9]), torch.tensor([0, 0, 4, 5]),
                         torch.tensor([30, 31, 32, 33]), torch.randn(4, 8), "expansion",
                         roots=torch.tensor([True, False, False, False]))
    msg = wire.to_wire(seg, wire_dtype)
    assert msg.node_ids is seg.node_ids and msg.parent_ids is seg.parent_ids   # no shift: no copy
    assert msg.root_rows.tolist() == [0]
    frames = [bytes(f) for f in msg.to_frames()]
    back = wire.from_wire(proto.decode(frames), torch.float32)
    assert (back.run_id, back.round_id, back.seq, back.prune_version, back.phase) == (3, 2, 7, 5, "expansion")
    for name in ("node_ids", "parent_ids", "positions", "roots"):
        assert torch.equal(getattr(back, name), getattr(seg, name))
    tol = 0 if wire_dtype == "float32" else 1e-2
    assert back.hidden.dtype == torch.float32
    torch.testing.assert_close(back.hidden, seg.hidden, atol=tol, rtol=tol)


def test_prefill_segments_carry_no_tree_ids_and_prune_keeps_end_round():
    n = 4
    seg = events.Segment.prefill(1, 0, torch.arange(n), torch.zeros(n, 2))
    msg = wire.to_wire(seg, "float32")
    assert msg.node_ids.numel() == msg.parent_ids.numel() == 0 and msg.root_rows is None and len(msg) == n
    back = wire.from_wire(proto.decode(msg.to_frames()), torch.float32)
    assert len(back) == n and back.node_ids.numel() == 0 and back.roots is None
    prune = events.Prune(1, 0, 3, PruneSet(torch.tensor([2, 5]), torch.tensor([6, 7]), 9), True)
    frames = wire.to_wire(prune, "float16").to_frames()
    back = wire.from_wire(proto.decode(frames), torch.float32)
    assert back.end_round and back.version == 3 and back.prune.horizon == 9
    assert back.prune.commit.tolist() == [2, 5] and back.prune.keep.tolist() == [6, 7]
    assert proto.decode(frames).commit_ids.dtype == torch.int64
    assert isinstance(wire.from_wire(proto.decode(wire.to_wire(events.Finish(4), "float16").to_frames()),
                                     torch.float32), events.Finish)


def test_node_config_defaults_are_valid():
    cfg = NodeConfig()
    assert cfg.role == "head" and cfg.wire_dtype == "float32" and cfg.keys_path.name == "keys"


def test_stage_chosen_tokens_and_sampling_params_survive_the_wire():
    from flowedge.core.sampling import SamplingParams

    seg = events.Segment(1, 0, 1, 0, torch.tensor([0, 3]), torch.tensor([0, 0]), torch.tensor([5, 6]),
                         None, "init-segment", tokens=torch.tensor([42, 0]),
                         roots=torch.tensor([True, False]))
    msg = wire.to_wire(seg, "float16")
    assert msg.hidden is None and msg.token_ids.tolist() == [42, 0]    # token 0 is a token, not "none"
    back = wire.from_wire(proto.decode([bytes(f) for f in msg.to_frames()]), torch.float32)
    assert back.tokens.tolist() == [42, 0] and back.hidden is None and back.sampling is None
    params = SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=11)
    pre = events.Segment.prefill(1, 1, torch.arange(2), torch.randn(2, 4), params)
    back = wire.from_wire(proto.decode([bytes(f) for f in wire.to_wire(pre, "float32").to_frames()]), torch.float32)
    assert back.sampling == params and back.tokens is None
    chosen = events.Segment.prefill(1, 1, torch.arange(2), torch.randn(2, 4)).chosen(
        torch.tensor([9]))   # the one choice after the chunk, no hidden states
    back = wire.from_wire(proto.decode(wire.to_wire(chosen, "float16").to_frames()), torch.float32)
    assert back.tokens.tolist() == [9] and back.hidden is None and len(back) == 2
    with pytest.raises(ProtocolError, match="token choices"):   # neither hidden states nor tokens
        wire.to_wire(chosen.chosen(None), "float16")


def test_bad_sampling_fields_are_protocol_errors():
    with pytest.raises(ProtocolError, match="top_p"):
        proto.Segment(run_id=1, round_id=0, seq=0, prune_version=0, kind="prefill", sent_at_step=0,
                      node_ids=torch.zeros(0, dtype=torch.long), parent_ids=torch.zeros(0, dtype=torch.long),
                      positions=torch.zeros(1, dtype=torch.long), hidden=torch.zeros(1, 2), temperature=1.0,
                      top_p=0.0)


def test_a_head_config_may_name_a_draft_head(tmp_path, monkeypatch):
    from flowedge.models.draft_head_spec import trained_path

    monkeypatch.setenv("FLOWEDGE_HOME", str(tmp_path))
    with pytest.raises(ConfigError, match="no draft head named 'mine'"):
        NodeConfig(draft="head:mine")
    path = trained_path("mine")
    path.parent.mkdir(parents=True)
    path.write_bytes(b"")   # the config check only resolves the name; loading checks the file
    assert NodeConfig(draft="head:mine").draft == "head:mine"
    with pytest.raises(ConfigError, match="needs a draft model"):
        NodeConfig(draft="head:mine", predraft="drafter")


def test_a_free_port_run_lies_below_the_ephemeral_range_and_is_free():
    """Ports a local cluster binds later are picked where no outgoing connection's source port can land."""
    import socket

    from flowedge.transport.addresses import _ephemeral_range, free_port_run

    low, _ = _ephemeral_range()
    for span in (1, 3):
        port = free_port_run(span)
        assert 1024 <= port and port + span <= low
        for k in range(span):
            with socket.socket() as s:
                s.bind(("127.0.0.1", port + k))

"""Every error class lives in flowedge/errors.py, under one base, and stays importable where it was public."""
from __future__ import annotations

import ast
import builtins
from pathlib import Path

import msgpack
import pytest

import flowedge
from flowedge import errors

PACKAGE = Path(flowedge.__file__).resolve().parent


def _error_names(module: object) -> set[str]:
    return {name for name, obj in vars(module).items() if isinstance(obj, type) and issubclass(obj, BaseException)}


ERROR_NAMES, BUILTIN_ERRORS = _error_names(errors), _error_names(builtins)


def error_classes_outside_errors_py() -> list[str]:
    """`path:line Name` for each class in the package whose base is an exception (builtin or ours)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "errors.py" and path.parent == PACKAGE:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases}
                if bases & (ERROR_NAMES | BUILTIN_ERRORS):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}")
    return found


def test_every_error_class_is_in_errors_py():
    assert error_classes_outside_errors_py() == []


def test_the_guard_can_fail(tmp_path, monkeypatch):
    (tmp_path / "errors.py").write_text("")
    (tmp_path / "stray.py").write_text("class Oops(ValueError):\n    pass\nclass Fine:\n    pass\n")
    monkeypatch.setattr(__import__(__name__), "PACKAGE", tmp_path)
    assert error_classes_outside_errors_py() == ["stray.py:1 Oops"]


def test_one_hierarchy_under_flowedge_error():
    for name in ERROR_NAMES - {"FlowedgeError"}:
        assert issubclass(getattr(errors, name), errors.FlowedgeError), name


@pytest.mark.parametrize("module, name", [
    ("flowedge", "StageLost"), ("flowedge", "RequestFailed"), ("flowedge", "ContextOverflow"),
    ("flowedge.node.membership", "StageLost"), ("flowedge.node.stage_node", "Rejoin"),
    ("flowedge.text.prompts", "PromptError"), ("flowedge.plan.partition", "PlanError"),
    ("flowedge.kernels.build", "BuildError"), ("flowedge.transport.validate", "InvalidMessage"),
    ("flowedge.client.sync_client", "RequestFailed"),
])
def test_moved_names_are_the_same_class_where_they_were(module, name):
    import importlib

    assert getattr(importlib.import_module(module), name) is getattr(errors, name)


def test_stage_lost_is_one_class_an_event_and_an_error():
    lost = errors.StageLost(2, "edge-b", "silent for 2.5 s (missed heartbeats)")
    assert lost == errors.StageLost(2, "edge-b", "silent for 2.5 s (missed heartbeats)")
    assert lost != errors.StageLost(1, "edge-b", "silent for 2.5 s (missed heartbeats)")
    assert len({lost, errors.StageLost(2, "edge-b", "silent for 2.5 s (missed heartbeats)")}) == 1
    assert str(lost) == lost.describe() == "stage 2 (edge-b) silent for 2.5 s (missed heartbeats)"
    with pytest.raises(flowedge.FlowedgeError, match="stage 2"):
        raise lost


def test_invalid_message_keeps_its_rule_and_bounds_its_detail():
    err = errors.InvalidMessage("hidden_width", "x" * 5000)
    assert err.rule == "hidden_width" and isinstance(err, errors.ProtocolError)
    assert str(err).startswith("hidden_width: ") and len(str(err)) < 300


def test_a_refusal_and_a_version_mismatch_are_told_by_type_not_text():
    """A node backs off from a head that said no (Refused) and gives up a silent one: it asks the type,
    so a silent head's message that happens to say "refused" or "protocol" changes nothing."""
    from flowedge.transport import protocol as p
    from flowedge.transport.channel import check_welcome

    with pytest.raises(errors.Refused, match="refused by peer: a stage already holds slot 1"):
        check_welcome(p.Refuse(reason="a stage already holds slot 1"), 1.0)
    newer = [msgpack.packb({"v": [99, 0], "type": "reset", "run_id": 1, "tensors": {}})]
    with pytest.raises(errors.VersionMismatch):
        p.decode(newer)
    with pytest.raises(errors.ProtocolError) as silent:
        check_welcome(None, 1.0)
    assert not isinstance(silent.value, errors.Refused)
    assert not isinstance(errors.ProtocolError("refused: the protocol"), errors.Refused)

"""One composition root per process kind: the roots (node/roots.py, the scheduler's `make_engine`, the
engine assembly) build the object graph and constructors receive their dependencies; no code patches a
collaborator onto an object after it is built. Read from the source with `ast` (nothing is imported).

What counts as a patch: assigning a lambda or a `partial` to an attribute of another object (`x.f = lambda
...`, `self.x.f = partial(...)`, `setattr(x, "f", lambda ...)`), or assigning, on another object, one of
the collaborators that used to be patched in (`deliver`, `present`, `clock`, `prediction`,
`running_requests`), whatever the value. Plain data (`req.state = State.DONE`) is not a patch.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "flowedge"
# the ports once patched in after construction: each now comes through a constructor or with each call
ONCE_PATCHED = frozenset({"deliver", "present", "clock", "prediction", "running_requests"})


def _is_own(target: ast.expr) -> bool:
    """`self.x` / `cls.x`: an object setting its own attribute (its constructor, its own state)."""
    return isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
        and target.value.id in ("self", "cls")


def _is_callable_value(value: ast.expr) -> bool:
    if isinstance(value, ast.Lambda):
        return True
    return isinstance(value, ast.Call) and ast.unparse(value.func).split(".")[-1] == "partial"


def _targets(node: ast.AST) -> list[ast.expr]:
    if isinstance(node, ast.Assign):
        flat: list[ast.expr] = []
        for t in node.targets:
            flat += t.elts if isinstance(t, ast.Tuple) else [t]
        return flat
    return [node.target] if isinstance(node, ast.AnnAssign) else []


def patches(source: str, name: str = "<snippet>") -> list[str]:
    """Every post-construction patch in `source`, as `name:line: code`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                and len(node.args) == 3 and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "self") \
                and _is_callable_value(node.args[2]):
            found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
        value = getattr(node, "value", None)
        for t in _targets(node):
            if not isinstance(t, ast.Attribute) or _is_own(t) or value is None:
                continue
            if _is_callable_value(value) or t.attr in ONCE_PATCHED:
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_object_is_patched_after_it_is_built():
    found = [p for path in sorted(PACKAGE.rglob("*.py"))
             for p in patches(path.read_text(), str(path.relative_to(PACKAGE.parent)))]
    assert not found, "pass these through a constructor (or with each call) instead:\n" + "\n".join(found)


def test_the_guard_catches_the_patches_it_is_for():
    snippet = """
drafts.deliver = requests.deliver
head.predraft.present = lambda: bool(members.drafters())
req.engine.clock = lambda: self.now_s
strategy.prediction = predict_from_costs(costs)
self.scheduler.run = partial(step, 1)
setattr(engine, "hook", lambda: None)
"""
    assert [p.split(":")[1] for p in patches(snippet)] == ["2", "3", "4", "5", "6", "7"]


def test_the_guard_leaves_constructors_and_plain_data_alone():
    snippet = """
class Head:
    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.running_requests = lambda: 1
        self.present: Callable[[], bool] = lambda: True

def end(req):
    req.state = State.DONE
    req.last_progress_s = now
"""
    assert patches(snippet) == []

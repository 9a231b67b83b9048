"""The package's layout, read from the source with `ast` (nothing here imports flowedge): which packages
may import which, no import cycle between modules, rules such as "the engine imports no driver", and the
size limits (modules of at most 400 lines, functions of at most 50).

Every import counts: top-level, inside a function, under `if TYPE_CHECKING:`. The one exception is the
cycle check, which skips `TYPE_CHECKING` imports: they never run, and a read-only view naming the class
it wraps (`engine/round_view.py` -> `engine/head.py`) is a type, not a dependency at run time.

When a change legitimately adds a dependency between packages, add it to `ALLOWED` (and say so in the
change's notes); the table must stay acyclic, so a new edge that closes a loop fails here.
"""
from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "flowedge"
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 50

# What each part of flowedge may import of the others, bottom to top. A "part" is a subpackage or a
# module directly under flowedge/; "flowedge" is the root __init__ (the public faces it re-exports).
ALLOWED: dict[str, frozenset[str]] = {k: frozenset(v) for k, v in {
    # the bottom: plain helpers that import no other part
    "errors": (),
    "filenames": (),
    "progress": (),
    "home": (),
    "threads": (),
    "allocator": (),
    "shipped": (),
    "systemd": ("shipped",),
    "datasets": ("errors", "home"),
    # the text room: tokenizer, prompts to token ids, an answer's ids back to text (below the engine)
    "text": ("errors",),
    # the pure speculation core, then the costs of running it on profiled devices
    "core": ("errors",),
    "costs": ("core", "errors", "shipped"),
    # the model runtime
    "kernels": ("errors", "home"),
    "models": ("allocator", "errors", "filenames", "home", "kernels", "progress"),
    # the sans-IO engine, and the wire (independent of each other)
    "engine": ("core", "costs", "errors", "models", "text"),
    "transport": ("core", "errors", "filenames", "home"),
    # drivers and users of the engine
    "sim": ("core", "costs", "engine", "errors", "models", "text"),
    "generate": ("core", "engine", "errors", "models", "sim", "text"),
    "plan": ("core", "costs", "datasets", "engine", "errors", "models", "sim", "text"),
    # the client (torch-free: `pip install flowedge` with no extra) talks to a head over the wire, nothing more
    "client": ("errors", "home", "transport"),
    # what a node process runs (head, stage, standby, drafter), then the commands that start and ask nodes
    "node": ("allocator", "core", "costs", "engine", "errors", "filenames", "home", "models", "plan", "progress",
             "systemd", "text", "transport"),
    "launch": ("allocator", "client", "core", "errors", "home", "node", "progress", "threads", "transport"),
    "bench": ("client", "core", "costs", "datasets", "engine", "errors", "launch", "models", "node", "sim", "text"),
    # self-distillation of a draft head from its base model (`flowedge draft-head train`)
    "distill": ("datasets", "engine", "errors", "models", "progress", "text", "threads"),
    "api": ("allocator", "client", "errors", "launch", "systemd", "transport"),
    # the composition root and the public faces
    "cli": ("api", "bench", "core", "datasets", "distill", "engine", "errors", "launch", "models", "node", "plan",
            "generate", "systemd", "threads", "transport"),
    "flowedge": ("client", "errors"),
    "__main__": ("cli",),
}.items()}


@dataclass(frozen=True)
class Forbidden:
    """`imported` (a module or a prefix of one, flowedge's or a third party's) may not be imported by
    modules of the parts in `importers` (empty: every part) other than those in `exempt`."""
    imported: str
    why: str
    importers: tuple[str, ...] = ()
    exempt: tuple[str, ...] = ()

    def applies(self, part: str, name: str) -> bool:
        hits = name == self.imported or name.startswith(self.imported + ".")
        return hits and (not self.importers or part in self.importers) and part not in self.exempt


# Rules the table alone does not say, or says too quietly to be noticed when someone widens it.
RULES: list[Forbidden] = [
    *(Forbidden(f"flowedge.{driver}", "the engine is sans-IO: drivers drive it, it knows none of them",
                importers=("engine",)) for driver in ("sim", "node", "launch", "client", "api", "transport", "cli")),
    Forbidden("torch", "the client installs without torch (`pip install flowedge`, no extra)", importers=("client",)),
    Forbidden("torch", "the HTTP front runs on a gateway without torch (the `http` extra has none)",
              importers=("api",)),
    Forbidden("zmq", "ZeroMQ stays behind the link seam (transport/link.py): nodes, clients and the http "
                     "front hold a Link, never a socket", exempt=("transport",)),
]

# Modules ("path") or functions ("path:Qual.name") over a limit while someone splits them, each with a
# comment saying who and why. Empty now: the last two (node/head_requests.py, SimCluster.run_many) went with
# the one scheduler. Anything else over a limit fails, and so does an entry that is no longer over.
PENDING: set[str] = set()


@dataclass(frozen=True)
class Import:
    module: str        # the importing module, e.g. flowedge.engine.head
    name: str          # what it imports: a module name (flowedge's resolved to a module) or a third party's
    line: int
    type_only: bool    # under `if TYPE_CHECKING:`


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def part_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "flowedge"


def _resolve(name: str) -> str:
    """The flowedge module `name` lives in (`flowedge.x.y.func` -> `flowedge.x.y`)."""
    known = modules()
    while name not in known and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    if isinstance(node, ast.Import):
        for alias in node.names:
            yield alias.name
        return
    base = node.module or ""
    if node.level:   # relative: from the importing module's package
        package = module if modules()[module].name == "__init__.py" else module.rsplit(".", 1)[0]
        package = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
        base = f"{package}.{base}" if base else package
    for alias in node.names:
        yield f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules() else base


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


@cache
def imports() -> tuple[Import, ...]:
    found: list[Import] = []
    for module, path in modules().items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        typed = _type_checking_lines(tree)
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for name in _targets(module, node):
                    name = _resolve(name) if name.split(".")[0] == "flowedge" else name
                    found.append(Import(module, name, node.lineno, node.lineno in typed))
    return tuple(found)


def internal(imp: Import) -> bool:
    return imp.name.split(".")[0] == "flowedge" and imp.name != imp.module


def test_every_part_of_the_package_has_a_row_in_the_table() -> None:
    missing = sorted({part_of(m) for m in modules()} - set(ALLOWED))
    assert not missing, f"parts with no row in ALLOWED (place them in the layering): {missing}"


def test_the_table_itself_is_acyclic() -> None:
    order: list[str] = []
    state: dict[str, str] = {}

    def visit(part: str, path: tuple[str, ...]) -> None:
        if state.get(part) == "done":
            return
        assert state.get(part) != "open", f"ALLOWED has a cycle: {' -> '.join((*path, part))}"
        state[part] = "open"
        for dep in sorted(ALLOWED.get(part, ())):
            visit(dep, (*path, part))
        state[part] = "done"
        order.append(part)

    for part in sorted(ALLOWED):
        visit(part, ())
    assert set(order) == set(ALLOWED)


def test_each_part_imports_only_what_the_table_allows() -> None:
    bad = {f"{imp.module} imports {imp.name} (line {imp.line}): {part_of(imp.module)} may import only "
           f"{sorted(ALLOWED.get(part_of(imp.module), ()))}"
           for imp in imports() if internal(imp)
           and part_of(imp.name) != part_of(imp.module)
           and part_of(imp.name) not in ALLOWED.get(part_of(imp.module), ())}
    assert not bad, "imports across the layering:\n" + "\n".join(sorted(bad))


def test_no_forbidden_imports() -> None:
    bad = {f"{imp.module} imports {imp.name} (line {imp.line}): {rule.why}"
           for imp in imports() for rule in RULES if rule.applies(part_of(imp.module), imp.name)}
    assert not bad, "\n".join(sorted(bad))


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (as a path that ends where it starts), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle_between_modules() -> None:
    graph: dict[str, set[str]] = {}
    for imp in imports():
        if internal(imp) and not imp.type_only:
            graph.setdefault(imp.module, set()).add(imp.name)
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) is None


def test_the_import_reader_sees_function_level_and_type_only_imports() -> None:
    head_imports = {(i.name, i.type_only) for i in imports() if i.module == "flowedge.engine.round_view"}
    assert ("flowedge.engine.head", True) in head_imports
    lazy = [i for i in imports() if i.module == "flowedge.cli" and i.name == "flowedge.generate"]
    assert lazy and not lazy[0].type_only   # imported inside `generate`


def sizes() -> Iterator[tuple[str, int, int]]:
    """(key, lines, limit) for every module and every function (nested ones too; key path:Qual.name)."""
    for module, path in modules().items():
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(ROOT).as_posix()
        yield rel, len(text.splitlines()), MAX_MODULE_LINES
        yield from _function_sizes(ast.parse(text), rel, "")


def _function_sizes(node: ast.AST, rel: str, prefix: str) -> Iterator[tuple[str, int, int]]:
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{child.name}"
            if not isinstance(child, ast.ClassDef):
                yield f"{rel}:{name}", (child.end_lineno or child.lineno) - child.lineno + 1, MAX_FUNCTION_LINES
            yield from _function_sizes(child, rel, f"{name}.")
        else:
            yield from _function_sizes(child, rel, prefix)


def test_no_module_or_function_over_its_limit() -> None:
    over = [f"{key}: {lines} lines (limit {limit})" for key, lines, limit in sizes()
            if lines > limit and key not in PENDING]
    assert not over, "split these:\n" + "\n".join(over)


def test_pending_entries_are_still_over_their_limit() -> None:
    """PENDING only shrinks: an entry that was split (or removed) must leave the set."""
    over = {k for k, lines, limit in sizes() if lines > limit}
    assert not PENDING - over, f"within their limits now, remove from PENDING: {sorted(PENDING - over)}"

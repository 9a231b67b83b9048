"""The type checker over flowedge/, with a ratchet for the errors not fixed yet.

mypy runs with setup.cfg's [mypy] section. tests/mypy_pending.json lists, per module, how many errors
it still reports there; the list may only shrink. A module with more errors than listed fails (a new
error), and so does one with fewer (the fix is real: lower the count, so the error cannot come back).
After fixing errors, `python tests/test_types.py --write` rewrites the file from a fresh run; review
the diff, it must only go down.

The cache lives in the system's temp dir, kept between runs (mypy checks it against the sources), so a
rerun takes seconds and a cold run well under a minute.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PENDING = Path(__file__).with_name("mypy_pending.json")
ERROR = re.compile(r"^(?P<path>[^:\s]+\.py):\d+(?::\d+)?: error: (?P<message>.*)$")


def run_mypy(*targets: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """mypy as CI runs it: setup.cfg's settings, the cache in the temp dir (per user)."""
    cache = Path(tempfile.gettempdir()) / f"flowedge-mypy-cache-{os.getuid()}"
    return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "setup.cfg"),
                           "--cache-dir", str(cache), "--no-error-summary", *targets],
                          cwd=cwd, capture_output=True, text=True, timeout=600)


def errors_per_module(output: str) -> Counter[str]:
    """How many errors mypy reported in each file (notes and summaries are not errors)."""
    found: Counter[str] = Counter()
    for line in output.splitlines():
        match = ERROR.match(line)
        if match:
            found[match["path"]] += 1
    return found


def ratchet_breaks(found: Counter[str], pending: dict[str, int]) -> list[str]:
    """What differs between the errors found and those listed as pending (empty: the ratchet holds)."""
    breaks = []
    for module in sorted(set(found) | set(pending)):
        now, listed = found.get(module, 0), pending.get(module, 0)
        if now > listed:
            breaks.append(f"{module}: {now} errors, {listed} pending: new type errors (see mypy's output)")
        elif now < listed:
            breaks.append(f"{module}: {now} errors, {listed} pending: lower its count in {PENDING.name}")
    return breaks


def test_flowedge_type_checks_within_the_pending_list() -> None:
    proc = run_mypy()
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]   # 2: mypy itself failed
    found = errors_per_module(proc.stdout)
    breaks = ratchet_breaks(found, json.loads(PENDING.read_text()))
    new = [line for line in proc.stdout.splitlines()
           if ERROR.match(line) and any(b.startswith(ERROR.match(line)["path"] + ":") for b in breaks)]
    assert not breaks, "\n".join(breaks + ["", *new[:60]])


def test_the_ratchet_fails_on_a_new_error_and_on_a_stale_count() -> None:
    output = ("flowedge/a.py:3: error: Incompatible types  [assignment]\n"
              "flowedge/a.py:9:5: error: Item \"None\" has no attribute \"x\"  [union-attr]\n"
              "flowedge/a.py:9: note: a note is not an error\n"
              "flowedge/b.py:1: error: Name \"y\" is not defined  [name-defined]\n")
    found = errors_per_module(output)
    assert found == Counter({"flowedge/a.py": 2, "flowedge/b.py": 1})
    assert ratchet_breaks(found, {"flowedge/a.py": 2, "flowedge/b.py": 1}) == []
    assert ratchet_breaks(found, {"flowedge/a.py": 2})[0].startswith("flowedge/b.py: 1 errors, 0 pending: new")
    assert "lower its count" in ratchet_breaks(found, {"flowedge/a.py": 3, "flowedge/b.py": 1})[0]


def test_the_settings_catch_a_real_mistake(tmp_path: Path) -> None:
    """The same command on a module with one type mistake reports it: the check is not passing for want
    of types or of files."""
    (tmp_path / "mistake.py").write_text("def half(n: int) -> int:\n    return n / 2\n")
    proc = run_mypy("mistake.py", cwd=tmp_path)
    assert errors_per_module(proc.stdout) == Counter({"mistake.py": 1}), proc.stdout + proc.stderr


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    counts = errors_per_module(run_mypy().stdout)
    PENDING.write_text(json.dumps(dict(sorted(counts.items())), indent=1) + "\n")
    print(f"{sum(counts.values())} errors pending in {len(counts)} modules")

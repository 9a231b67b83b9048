"""tools/bench_vs_llamacpp.py: the schedule, the measures and the tables of the llama.cpp A/B, and the
llama.cpp peer itself (docs/bench/llamacpp/bench.mjs) where it is installed."""
from __future__ import annotations

import importlib.util
import json
import shutil
import resource
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_tool():
    spec = importlib.util.spec_from_file_location("bench_vs_llamacpp", ROOT / "tools" / "bench_vs_llamacpp.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_vs_llamacpp"] = module
    spec.loader.exec_module(module)
    return module


bvl = _load_tool()


def run(side, kind="code", prompt="p1", threads=1, repeat=0, new=11, decode_s=2.0, rss=100.0, tokens=None):
    return bvl.Run(side, threads, prompt, kind, repeat, new, decode_s, None, 0.5, rss,
                   tokens if tokens is not None else list(range(new)))


def test_common_prefix_stops_at_the_first_difference():
    assert bvl.common_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert bvl.common_prefix([1, 2], [1, 2, 3]) == 2
    assert bvl.common_prefix([], [1]) == 0


def test_decode_rate_leaves_out_the_first_token():
    assert bvl.decode_rate(11, 2.0) == 5.0
    assert bvl.decode_rate(1, 2.0) is None and bvl.decode_rate(5, None) is None


def test_schedule_runs_every_side_on_a_prompt_before_the_next_and_reverses_on_odd_repeats():
    cases = [bvl.Case("a", "code", "x", (1,)), bvl.Case("b", "writing", "y", (2,))]
    order = [(r, c.prompt_id, s) for r, c, s in bvl.schedule(cases, ["llama.cpp", "ar", "tree"], 2)]
    assert order[:3] == [(0, "a", "llama.cpp"), (0, "a", "ar"), (0, "a", "tree")]
    assert order[6:9] == [(1, "a", "tree"), (1, "a", "ar"), (1, "a", "llama.cpp")]
    assert len(order) == 12


def test_pooled_rate_weighs_prompts_by_their_decode_time():
    runs = [run("ar", new=11, decode_s=1.0), run("ar", new=11, decode_s=4.0)]   # 10 tok/s and 2.5 tok/s
    assert bvl.pooled_rate(runs) == pytest.approx(20 / 5.0)
    assert bvl.pooled_rate([run("ar", new=1, decode_s=0.0)]) is None


def test_speed_table_gives_each_kind_and_overall_with_the_ratio_to_llama_cpp_and_peak_rss():
    runs = [run("llama.cpp", "code", decode_s=1.0, rss=1900), run("ar", "code", decode_s=4.0, rss=2300),
            run("llama.cpp", "writing", "p2", decode_s=1.0, rss=1950), run("ar", "writing", "p2", decode_s=2.0)]
    rows = bvl.speed_table(runs, ["llama.cpp", "ar"], 1)
    code = next(r for r in rows if r.startswith("| code "))
    assert code == "| code | 10.00 | 2.50 (0.25×) | 1900 | 2300 |"
    overall = next(r for r in rows if "overall" in r)
    assert "3.33 (0.33×)" in overall and "| 1950 | 2300 |" in overall


def test_prefix_table_compares_each_side_with_llama_cpp_on_the_first_repeat():
    runs = [run("llama.cpp", tokens=[5, 6, 7, 8]), run("ar", new=4, tokens=[5, 6, 9, 9]),
            run("ar", new=4, repeat=1, tokens=[5, 6, 7, 8])]
    rows = bvl.prefix_table(runs, ["llama.cpp", "ar"])
    assert rows[2] == "| 1 | p1 | code | 2/4 |"


def test_run_measured_reports_the_child_s_own_peak_memory_and_refuses_a_failure():
    stdout, _, rss_mb = bvl.run_measured([sys.executable, "-c", "b = bytearray(300 * 2**20); print('{}')"])
    # Linux starts a child's high-water mark at its parent's RSS when it forks (the pages are shared until
    # exec), so under a big pytest process the figure is at most the parent's; a bench driver is small.
    parent_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert stdout.strip() == "{}" and 300 < rss_mb < max(1000, parent_mb + 50)
    with pytest.raises(RuntimeError, match="exited 3"):
        bvl.run_measured([sys.executable, "-c", "import sys; sys.exit(3)"])


def test_run_measured_kills_a_child_past_its_deadline():
    with pytest.raises(RuntimeError, match="exited -9"):
        bvl.run_measured([sys.executable, "-c", "import time; time.sleep(30)"], timeout_s=0.5)


PEER = ROOT / "docs" / "bench" / "llamacpp"


@pytest.mark.real_model
@pytest.mark.skipif(not (PEER / "node_modules" / "node-llama-cpp").is_dir() or shutil.which("node") is None
                    or not bvl.DEFAULT_GGUF.is_file(), reason="llama.cpp peer not installed (npm ci) or no GGUF")
def test_the_llama_cpp_peer_decodes_exactly_n_greedy_tokens_from_given_ids_twice_the_same():
    prompts = "".join(json.dumps({"id": i, "tokens": [151644, 872, 198, 9707, 151645, 198, 151644, 77091, 198]})
                      + "\n" for i in ("a", "b"))
    proc = subprocess.run(["node", str(PEER / "bench.mjs"), "--model", str(bvl.DEFAULT_GGUF), "--threads", "1",
                           "--max-new-tokens", "4"], input=prompts, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    a, b = (json.loads(line) for line in proc.stdout.splitlines())
    assert a["id"] == "a" and a["prompt_tokens"] == 9 and a["new_tokens"] == 4 and len(a["token_ids"]) == 4
    assert a["token_ids"] == b["token_ids"]   # greedy: the second prompt starts from a cleared sequence
    assert a["decode_tokens_per_s"] == pytest.approx(3 / a["decode_s"], rel=1e-2)
    assert json.loads(proc.stderr.splitlines()[-1])["gpu"] is False


def test_a_built_llama_server_s_answer_is_measured_as_flowedge_measures_itself():
    """predicted_ms runs from the first sampled token to the last: (n - 1) steps, as flowedge's decode rate."""
    import llama_server_peer

    res = {"tokens": [5, 6, 7], "timings": {"predicted_n": 11, "predicted_ms": 500.0, "prompt_ms": 80.0,
                                            "predicted_per_second": 22.0}}
    got = llama_server_peer.answer_figures(res)
    assert got["decode_tokens_per_s"] == pytest.approx(20.0)
    assert got["decode_s"] == pytest.approx(0.5) and got["prefill_s"] == pytest.approx(0.08)
    assert got["token_ids"] == [5, 6, 7] and got["llama_predicted_per_second"] == 22.0
    assert llama_server_peer.answer_figures({"timings": {"predicted_n": 1, "predicted_ms": 3.0}})[
        "decode_tokens_per_s"] is None

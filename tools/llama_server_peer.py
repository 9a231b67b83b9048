"""llama.cpp built from source as the decode-speed peer: one `llama-server` per thread count, prompted
over HTTP with the same token ids flowedge decodes (a benchmark tool, never a dependency).

The binaries come from `tools/llamacpp_build.py` (`--print-dir` prints their folder). The rate compared is
the one flowedge reports, (new tokens - 1) / (time after the first token): llama-server's `predicted_ms`
runs from the first sampled token to the last, so (predicted_n - 1) / predicted_ms is the same measure.
Its own `predicted_per_second` (predicted_n / predicted_ms, about 1/n higher) is kept beside it.
"""
from __future__ import annotations

import json
import logging
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

from testbed.client import healthy_within   # the same /health poll the testbed's client does

from flowedge.transport.addresses import free_port_run

log = logging.getLogger("llama_server_peer")

READY_TIMEOUT_S = 120.0
ANSWER_TIMEOUT_S = 1800.0


class LlamaServer:
    """One llama-server process at `threads` threads on one GGUF, a single slot, no prompt cache."""

    def __init__(self, bin_dir: Path, gguf: Path, threads: int, context: int = 2048) -> None:
        self.bin_dir, self.gguf, self.threads, self.context = Path(bin_dir), Path(gguf), threads, context
        self.port = free_port_run(1)
        self.proc: subprocess.Popen | None = None
        self.url = f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LlamaServer:
        server = self.bin_dir / "llama-server"
        if not server.is_file():
            raise SystemExit(f"no llama-server in {self.bin_dir}: build it with tools/llamacpp_build.py")
        cmd = [str(server), "-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(self.port),
               "-t", str(self.threads), "-tb", str(self.threads), "-c", str(self.context), "-np", "1",
               "--no-webui"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()
        self.complete([151644, 872, 198], 8)   # untimed warm-up: first-call paths out of the timed runs
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def _wait_ready(self) -> None:
        proc = self.proc
        assert proc is not None
        if healthy_within(self.url, READY_TIMEOUT_S, gone=lambda: proc.poll() is not None):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"llama-server exited {proc.returncode} while loading {self.gguf}")
        raise RuntimeError(f"llama-server was not ready within {READY_TIMEOUT_S:.0f} s")

    def complete(self, ids: list[int], max_new: int) -> dict:
        body = {"prompt": ids, "n_predict": max_new, "temperature": 0.0, "top_k": 1, "cache_prompt": False,
                "return_tokens": True}
        req = urllib.request.Request(f"{self.url}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=ANSWER_TIMEOUT_S) as resp:
            return json.loads(resp.read())

    def peak_rss_mb(self) -> float:
        assert self.proc is not None
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def version(self) -> str:
        try:
            with urllib.request.urlopen(f"{self.url}/props", timeout=5) as resp:
                props = json.loads(resp.read())
            return str(props.get("build_info", "?"))
        except (urllib.error.URLError, OSError, ValueError):
            return "?"


def answer_figures(res: dict) -> dict:
    """new_tokens, decode_s, decode_tokens_per_s (flowedge's definition), prefill_s, token ids, llama's own."""
    t = res.get("timings", {})
    n, ms = int(t.get("predicted_n") or 0), float(t.get("predicted_ms") or 0.0)
    decode_s = ms / 1e3 if ms else None
    rate = (n - 1) / decode_s if decode_s and n > 1 else None
    return {"new_tokens": n, "decode_s": decode_s, "decode_tokens_per_s": rate,
            "prefill_s": (t.get("prompt_ms") or 0.0) / 1e3, "token_ids": list(res.get("tokens", [])),
            "llama_predicted_per_second": t.get("predicted_per_second")}

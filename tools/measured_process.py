"""Run a benchmark's child process to its end and read what it cost: its output and its own peak RSS
(wait4's ru_maxrss, which Popen.wait would discard)."""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 1800.0


def run_measured(cmd: list[str], stdin_text: str = "", timeout_s: float = RUN_TIMEOUT_S,
                 env: dict | None = None) -> tuple[str, str, float]:
    """Run cmd to the end; return its stdout, its stderr and its peak RSS in MB (ru_maxrss of that child)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=err, env=env, cwd=ROOT)
        proc.stdin.write(stdin_text.encode())
        proc.stdin.close()
        status, usage = _wait4(proc, time.monotonic() + timeout_s)
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(), err.read().decode()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[:4])} ... exited {proc.returncode}: {stderr.strip()[-800:]}")
    return stdout, stderr, usage.ru_maxrss / 1024   # Linux: kilobytes


def _wait4(proc: subprocess.Popen, deadline: float):
    """Reap proc with its own resource usage (Popen.wait would discard it); kill it past the deadline."""
    while True:
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            return status, usage
        if time.monotonic() > deadline:
            proc.kill()
            return os.wait4(proc.pid, 0)[1:]
        time.sleep(0.05)


def last_json(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise RuntimeError(f"no JSON line in the output: {stdout[-400:]!r}")
    return json.loads(lines[-1])

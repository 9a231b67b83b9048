"""A minimal Chrome DevTools Protocol client over `--remote-debugging-pipe` (fd 3 in, fd 4 out, each
message JSON ended by a NUL byte), so tests drive a real headless Chromium with no websocket library:
open a page, evaluate JavaScript in it, take a screenshot."""
from __future__ import annotations

import base64
import json
import os
import select
import subprocess
import time
from pathlib import Path


class Browser:
    def __init__(self, binary: str, profile: Path, width: int = 1100, height: int = 1000) -> None:
        to_chrome_r, self._w = os.pipe()
        self._r, from_chrome_w = os.pipe()
        args = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
                "--remote-debugging-pipe", f"--user-data-dir={profile}", f"--window-size={width},{height}"]

        def fds() -> None:   # the child's fd 3 reads our commands, its fd 4 writes the replies
            high_r, high_w = os.dup(to_chrome_r), os.dup(from_chrome_w)   # either may be 3 or 4 itself
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        # close_fds=False keeps the dup2'd 3 and 4 (Python's own descriptors are not inheritable anyway)
        self.proc = subprocess.Popen(args, preexec_fn=fds, close_fds=False,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buf, self._next, self.session = b"", 0, None

    def call(self, method: str, timeout_s: float = 30.0, session: bool = True, **params) -> dict:
        self._next += 1
        msg = {"id": self._next, "method": method, "params": params}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            while b"\0" in self._buf:
                raw, self._buf = self._buf.split(b"\0", 1)
                reply = json.loads(raw)
                if reply.get("id") == self._next:
                    if "error" in reply:
                        raise RuntimeError(f"{method}: {reply['error']}")
                    return reply.get("result", {})
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                raise TimeoutError(f"Chromium did not answer {method} in {timeout_s} s")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                raise RuntimeError(f"Chromium exited: {self.proc.stderr.read().decode()[-2000:]}")
            self._buf += chunk

    def open(self, url: str) -> None:
        target = self.call("Target.createTarget", session=False, url=url)["targetId"]
        self.session = self.call("Target.attachToTarget", session=False, targetId=target, flatten=True)["sessionId"]

    def eval(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        return result.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout_s: float):
        """Evaluate until truthy (returns the value) or the time is up (returns the last value)."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.eval(expression)
            if value or time.monotonic() > deadline:
                return value
            time.sleep(0.1)

    def screenshot(self, path: Path) -> None:
        path.write_bytes(base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"]))

    def close(self) -> None:
        try:
            self.call("Browser.close", session=False, timeout_s=5)
        except (RuntimeError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._w)
        os.close(self._r)

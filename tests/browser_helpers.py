"""Headless Chromium for the dashboard's tests, driven by playwright-python.

The browser is Debian's chromium (`executable_path`; `make browser` installs it), never one playwright
downloads (`playwright install` is not needed). `Page` keeps the four calls the tests make; over
playwright's own `Page` it adds only `wait_for` returning the last value at its deadline (the tests
assert on that value and print it) where playwright raises."""
from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None)


def why_not() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if CHROMIUM is None:
        return "no Chromium (apt-get install chromium; `make browser` installs it where it can)"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "no playwright (pip install playwright, in the test extra; no `playwright install` needed)"
    return None


class Page:
    """One tab of a fresh headless Chromium (its own profile), `width` x `height` CSS pixels."""

    def __init__(self, width: int = 1100, height: int = 1000) -> None:
        from playwright.sync_api import sync_playwright

        self._pw = sync_playwright().start()
        try:
            self._browser = self._pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                                     args=["--no-sandbox", "--disable-dev-shm-usage"])
            self.page = self._browser.new_page(viewport={"width": width, "height": height})
        except Exception:
            self._pw.stop()
            raise

    def open(self, url: str) -> None:
        self.page.goto(url)

    def eval(self, expression: str) -> Any:
        return self.page.evaluate(expression)

    def wait_for(self, expression: str, timeout_s: float) -> Any:
        """Evaluate until truthy (returns the value) or the time is up (returns the last value)."""
        from playwright.sync_api import TimeoutError as Timeout

        try:
            # as a function: a bare string would be eval'ed in the page, which its CSP (rightly) forbids
            self.page.wait_for_function(f"() => ({expression})", timeout=timeout_s * 1000, polling=100)
        except Timeout:
            pass
        return self.eval(expression)

    def screenshot(self, path: Path) -> None:
        self.page.screenshot(path=str(path))

    def close(self) -> None:
        try:
            self._browser.close()
        finally:
            self._pw.stop()

"""Headless Chromium for the live page (tests/entrypoints/test_live_page.py, scripts/live_page_screenshot.py):
Debian's `chromium` driven by Playwright (the `playwright` package; its own browser downloads are not used), and a
small load of streamed completions against a server."""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections.abc import Iterator

import httpx
import pytest

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
"""Headless as root in a container (Playwright adds --headless and a fresh --user-data-dir)."""


def require_chromium() -> None:
    """Skip without Debian's chromium or playwright outside CI; in CI (CI set) scripts/setup.sh installs both: fail."""
    missing = [what for what, ok in (("chromium (apt-get install chromium)", os.path.exists(CHROMIUM)),
                                     ("playwright (the test extra)", _has_playwright())) if not ok]
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"missing in CI: {', '.join(missing)}; scripts/setup.sh installs them")
        pytest.skip(f"not installed: {', '.join(missing)} (scripts/setup.sh does it as root)")


def _has_playwright() -> bool:
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def chromium_page(width: int = 1280, height: int = 900) -> Iterator:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
        finally:
            browser.close()


def number(text: str) -> float | None:
    """A figure as the page writes it: "1,234", "12.5%", "3.4 ms", "1.20 s"; None for "–"."""
    text = text.strip()
    if text in ("", "–"):
        return None
    value = float(re.sub(r"[^0-9.\-]", "", text))
    if text.endswith("%"):
        return value / 100
    if text.endswith(" ms"):
        return value / 1000
    return value


class Load:
    """`concurrency` threads streaming completions with a shared prompt prefix (prefix-cache hits) until stop()."""

    def __init__(self, url: str, model: str, api_key: str | None, concurrency: int = 4, max_tokens: int = 24):
        self.url, self.model, self.max_tokens = url, model, max_tokens
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.stopped = threading.Event()
        self.completed = 0
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(concurrency)]
        for t in self.threads:
            t.start()

    def _run(self, worker: int) -> None:
        prefix = "the live page shows what the engine is doing right now " * 4
        with httpx.Client(timeout=60.0) as client:
            n = 0
            while not self.stopped.is_set():
                n += 1
                body = {"model": self.model, "prompt": f"{prefix} worker {worker} request {n}",
                        "max_tokens": self.max_tokens, "stream": True, "ignore_eos": True}
                try:
                    with client.stream("POST", self.url + "/v1/completions", json=body, headers=self.headers) as r:
                        if r.status_code != 200:
                            self.errors.append(f"{r.status_code}: {r.read()[:200]!r}")
                        for _ in r.iter_lines():
                            pass
                    self.completed += 1
                except httpx.HTTPError as e:
                    self.errors.append(repr(e))

    def stop(self) -> None:
        self.stopped.set()
        for t in self.threads:
            t.join(60)

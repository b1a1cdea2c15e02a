"""Regenerate docs/live-page.png: the live page (GET /dashboard) of a real `pagedllm serve` under load, in headless
Chromium (Debian's `chromium` driven by Playwright, as tests/entrypoints/test_live_page.py does).

    PYTHONPATH=src .venv/bin/python scripts/live_page_screenshot.py [--seconds 40] [--out docs/live-page.png]

The server: the embedded default model (SmolLM2), two data-parallel replicas, ngram speculative decoding, four
sequences a replica; the load: streamed completions sharing a prompt prefix, more at once than fit in the batch (so
some wait). Not part of the tests: the picture changes on every run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "entrypoints")]

from live_page_browser import Load, chromium_page  # noqa: E402
from server_utils import RemoteServer  # noqa: E402

NAME = "SmolLM2-135M-Instruct"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=40.0, help="load before the screenshot")
    parser.add_argument("--concurrency", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "live-page.png")
    args = parser.parse_args()
    server = RemoteServer(None, "--data-parallel-size", "2", "--max-num-seqs", "4", "--max-model-len", "1024",
                          "--served-model-name", NAME,
                          "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                          debug_routes=False)
    try:
        with chromium_page(width=1280, height=1000) as page:
            page.goto(f"{server.url}/dashboard?interval=1000")
            page.wait_for_function("document.getElementById('status-text').textContent === 'live'")
            load = Load(server.url, NAME, None, concurrency=args.concurrency, max_tokens=48)
            try:
                time.sleep(args.seconds)
                updated = page.get_attribute("body", "data-updated")
                page.wait_for_function(f"document.body.dataset.updated !== '{updated}'")
                args.out.parent.mkdir(parents=True, exist_ok=True)
                page.screenshot(path=str(args.out), full_page=True)
            finally:
                load.stop()
            if load.errors:
                print("load errors:", load.errors[:3], file=sys.stderr)
    finally:
        server.close()
    print(f"wrote {args.out} ({load.completed} requests)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

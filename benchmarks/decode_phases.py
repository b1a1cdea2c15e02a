"""Per-phase wall time of decode steps at batch B: B prompts of 256 random ids, 40 output tokens, greedy.

    .venv/bin/python benchmarks/decode_phases.py [B] [output tokens, default 40] [wall|cpu] [engine args as JSON]

Wraps the model runner's phases and the layers' forward calls in timers, counts only steps where every running
request decodes, and prints milliseconds per step for each phase, the median over steps (robust to a shared
machine's preemptions) and the mean: where a small-batch step's time goes besides the linear layers. Phases
nest (a decoder layer contains its linears and attention; the LM head is a linear too). "attention" includes
rotary (PagedAttention takes the fused qkv projection since the rotary + KV write + attention fusion; before
it, rotary ran outside, in "decoder layers").

`cpu` times the phases in CPU time of the calling thread (time.thread_time) instead of wall time: with
OMP_NUM_THREADS=1 all the work runs on that thread, so the figures do not count the time other processes hold
the core (on a crowded machine wall time measures the queue, not the code).

Decode steps of a quantized model run as one native call (models/llama_native_step.py): "native decode step"
then holds the decoder layers and the final norm, and the per-module phases stay empty. PAGEDLLM_NATIVE_STEP=0
runs the modules instead (the before / after comparison).

Last, the weight-streaming floor of a batch-1 step (issue 38): the bytes a decode step reads (every tensor of the
default GGUF but the token embedding, which counts only when the LM head is tied to it) divided by the machine's
measured read bandwidth (a torch sum over a 512 MiB buffer on torch's threads, median of 15), and each phase's
ratio to it.
"""

import collections
import json
import statistics
import sys
import time

import numpy as np
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.core import EngineCore
from pagedllm.layers.attention import PagedAttention
from pagedllm.layers.linear import Linear
from pagedllm.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from pagedllm.models.llama_native_step import LlamaNativeDecodeStep
from pagedllm.models.resolve import resolve_model
from pagedllm.worker.model_runner import ModelRunner

PHASES = [
    (ModelRunner, "execute_model", "execute_model"),
    (ModelRunner, "_update_states", "update_states"),
    (ModelRunner, "_prepare_inputs", "prepare_inputs"),
    (LlamaForCausalLM, "forward", "model forward"),
    (LlamaNativeDecodeStep, "forward", "native decode step"),
    (LlamaDecoderLayer, "forward", "decoder layers"),
    (Linear, "forward", "linears incl. LM head"),
    (PagedAttention, "forward", "attention"),
    (LlamaForCausalLM, "compute_logits", "LM head (compute_logits)"),
    (ModelRunner, "_sample", "sample"),
]


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    clock = time.thread_time if len(sys.argv) > 3 and sys.argv[3] == "cpu" else time.perf_counter
    steps: list[dict[str, float]] = []  # per decode step: seconds per phase
    decoding = [False]

    def wrap(cls, name: str, label: str) -> None:
        orig = getattr(cls, name)

        def timed(*args, **kwargs):
            t0 = clock()
            result = orig(*args, **kwargs)
            if decoding[0]:
                steps[-1][label] += clock() - t0
            return result

        setattr(cls, name, timed)

    for cls, name, label in PHASES:
        wrap(cls, name, label)
    engine_step = EngineCore.step

    def step(self):
        running = self.scheduler.running
        decoding[0] = bool(running) and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running)
        if decoding[0]:
            steps.append(collections.defaultdict(float))
        return engine_step(self)

    EngineCore.step = step
    extra = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}  # engine args: {"activation_quantization": "int8"}
    llm = LLM(max_model_len=2048, kv_cache_memory=512 << 20, **extra)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, 256).tolist() for _ in range(batch)]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), use_tqdm=False)
    steps = [s for s in steps if "execute_model" in s]
    print(f"batch {batch}: {len(steps)} decode steps, {clock.__name__} ms per step: median, mean")
    for _, _, label in PHASES:
        values = [s[label] * 1e3 for s in steps]
        print(f"  {label:26s} {statistics.median(values):7.2f} {statistics.fmean(values):7.2f}")
    print_floor(statistics.median(s["execute_model"] for s in steps) * 1e3)


def weight_bytes_per_step() -> int:
    """Bytes of weights a decode step reads: the default GGUF's tensors, the token embedding only if tied."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(resolve_model(None).path).tensors}
    if "output.weight" in tensors:  # an LM head of its own: the embedding is a row lookup
        tensors.pop("token_embd.weight")
    return sum(tensors.values())


def read_bandwidth(mib: int = 512, repeats: int = 15) -> float:
    """Bytes per second a torch sum reads from a buffer far larger than the caches (torch's thread count)."""
    buffer = torch.ones(mib << 18, dtype=torch.float32)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        buffer.sum()
        times.append(time.perf_counter() - t0)
    return buffer.nbytes / statistics.median(times)


def print_floor(execute_ms: float) -> None:
    nbytes, bandwidth = weight_bytes_per_step(), read_bandwidth()
    floor_ms = nbytes / bandwidth * 1e3
    print(f"floor: {nbytes / 1e6:.1f} MB of weights per step / {bandwidth / 1e9:.1f} GB/s read bandwidth "
          f"({torch.get_num_threads()} threads) = {floor_ms:.2f} ms; execute_model {execute_ms:.2f} ms = "
          f"{execute_ms / floor_ms:.2f}x the floor")


if __name__ == "__main__":
    main()

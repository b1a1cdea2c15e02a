"""The native decode step (models/llama_native_step.py) against the module path, interleaved in one process: the
default SmolLM2 GGUF, B prompts of 256 random ids prefilled, then decode steps alternately native and modules,
each timed from the forward to the LM head's logits. Alternating step by step cancels the drift of a shared
machine's load, which a before / after pair of decode_phases.py runs does not.

    .venv/bin/python benchmarks/native_step_ab.py [B, default 1] [steps, default 40] [wall|cpu]

`cpu` times in CPU time of the calling thread; with OMP_NUM_THREADS=1 that is all the work (see decode_phases.py).
"""

import statistics
import sys
import time

import numpy as np
import torch

from pagedllm.config import ModelConfig
from pagedllm.layers.forward_context import AttentionMetadata, kv_cache_shape, set_forward_context
from pagedllm.models.llama_native_step import LlamaNativeDecodeStep
from pagedllm.models.loader import load_model
from pagedllm.worker.cpu_allocator import keep_freed_memory

BLOCK_SIZE = 16
MAX_BLOCKS = 20  # per request: 256 prompt tokens + up to 64 decodes


def main() -> None:
    batch = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    clock = time.thread_time if len(sys.argv) > 3 and sys.argv[3] == "cpu" else time.perf_counter
    model = load_model(ModelConfig(), torch.device("cpu"), torch.float32)
    info = model.info
    shape = kv_cache_shape(batch * MAX_BLOCKS, BLOCK_SIZE, info.num_kv_heads, info.head_dim)
    kv_caches = [torch.zeros(shape) for _ in range(info.num_layers)]
    keep_freed_memory()  # as the runner does
    native = LlamaNativeDecodeStep.build(model)
    assert native is not None, "the default model should run the native step"
    block_table = np.arange(batch * MAX_BLOCKS, dtype=np.int32).reshape(batch, MAX_BLOCKS)
    num_computed = np.zeros(batch, dtype=np.int64)

    def step(num_tokens: list[int], input_ids: list[int], use_native: bool) -> tuple[list[int], float]:
        """One step of num_tokens[i] new tokens per request -> (greedy next tokens, seconds)."""
        qsl = np.concatenate([[0], np.cumsum(num_tokens)]).astype(np.int64)
        positions = np.concatenate([np.arange(num_computed[i], num_computed[i] + n) for i, n in enumerate(num_tokens)])
        rows = np.repeat(np.arange(batch), num_tokens)
        slots = block_table[rows, positions // BLOCK_SIZE].astype(np.int64) * BLOCK_SIZE + positions % BLOCK_SIZE
        seq_lens = num_computed + num_tokens
        nb = int(-(-seq_lens.max() // BLOCK_SIZE))
        md = AttentionMetadata(len(input_ids), max(num_tokens), int(seq_lens.max()),
                               torch.from_numpy(qsl.astype(np.int32)), torch.from_numpy(seq_lens.astype(np.int32)),
                               torch.from_numpy(np.ascontiguousarray(block_table[:, :nb])), torch.from_numpy(slots),
                               qsl, seq_lens)
        t0 = clock()
        with torch.inference_mode(), set_forward_context(md, kv_caches):
            ids, pos = torch.tensor(input_ids), torch.from_numpy(positions)
            hidden = native.forward(ids, pos) if use_native else model(ids, pos)
            logits = model.compute_logits(hidden[torch.from_numpy(qsl[1:] - 1)])
        seconds = clock() - t0
        num_computed[:] = seq_lens
        return logits.argmax(-1).tolist(), seconds

    rng = np.random.default_rng(0)
    tokens, _ = step([256] * batch, rng.integers(100, 40000, 256 * batch).tolist(), False)
    times: dict[bool, list[float]] = {True: [], False: []}
    for i in range(steps):
        tokens, seconds = step([1] * batch, tokens, i % 2 == 0)
        times[i % 2 == 0].append(seconds)
    modules, fused = (statistics.median(times[k]) * 1e3 for k in (False, True))
    print(f"batch {batch}, {torch.get_num_threads()} threads, {clock.__name__} ms per decode step (forward + LM head), "
          f"median: modules {modules:.2f}, native {fused:.2f}, saved {modules - fused:.2f}")


if __name__ == "__main__":
    main()

"""CPU µs per streamed token of the API server's own per-token path, without a model or sockets.

One engine step per token for 16 requests: OutputProcessor.process_outputs (incremental detokenization with the
embedded SmolLM2 tokenizer, stop-string checks, RequestOutput) and the /v1/completions SSE chunk of each output
(OpenAIServingCompletion._stream). Compare builds with PYTHONPATH; the serving figures are benchmarks/serving_cpu.py's.

    PYTHONPATH=src python benchmarks/stream_path_cpu.py
"""

from __future__ import annotations

import asyncio
import random
import time

from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import get_tokenizer

NUM_REQUESTS, NUM_TOKENS = 16, 256


def main() -> None:
    tokenizer = get_tokenizer(None)
    rng = random.Random(0)
    processor = OutputProcessor(tokenizer)
    ids = [f"cmpl-{i}" for i in range(NUM_REQUESTS)]
    for req_id in ids:
        request = EngineCoreRequest(request_id=req_id, prompt_token_ids=[rng.randrange(1000, 40000) for _ in range(8)],
                                    sampling_params=SamplingParams(max_tokens=NUM_TOKENS, stop=["\n\n\n"]),
                                    eos_token_id=None, arrival_time=time.time())
        processor.add_request(request, None, output_kind="delta")
    steps = [EngineCoreOutputs(outputs=[EngineCoreOutput(request_id=req_id, new_token_ids=[rng.randrange(1000, 40000)])
                                        for req_id in ids]) for _ in range(NUM_TOKENS)]
    serving = object.__new__(OpenAIServingCompletion)
    serving.served_model_names = ["SmolLM2-135M-Instruct"]
    queues: dict[str, list] = {req_id: [] for req_id in ids}

    start = time.process_time()
    for step in steps:
        for output in processor.process_outputs(step).request_outputs:
            queues[output.request_id].append(output)
    detok_s = time.process_time() - start

    async def render(outputs) -> int:
        async def merged():
            for output in outputs:
                yield 0, output

        request = CompletionRequest(model="m", prompt="x", stream=True)
        return sum([len(c) async for c in serving._stream(request, "cmpl-1", [("x", [1])], merged())])

    start = time.process_time()
    for outputs in queues.values():
        asyncio.run(render(outputs))
    render_s = time.process_time() - start
    per_token = 1e6 / (NUM_REQUESTS * NUM_TOKENS)
    print(f"output processing (detokenize, stops, RequestOutput): {detok_s * per_token:.1f} µs/token; "
          f"SSE chunks: {render_s * per_token:.1f} µs/token")


if __name__ == "__main__":
    main()

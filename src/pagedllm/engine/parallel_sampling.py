"""n > 1 (parallel sampling): one request becomes n child requests, validated and registered together.

Both frontends (LLMEngine, AsyncLLM) add every request through `fan_out`: n == 1 is the request itself.
"""

from __future__ import annotations

from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.output_processor import OutputKind, OutputProcessor, ParentRequest
from pagedllm.messages import EngineCoreRequest, LoRARequest
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams


def fan_out(input_processor: InputProcessor, output_processor: OutputProcessor, request_id: str,
            prompt_token_ids: list[int], params: SamplingParams, prompt: str | None, output_kind: OutputKind,
            arrival_time: float | None = None, priority: int = 0,
            cache_salt: str | None = None, pooling_params: PoolingParams | None = None,
            lora_request: LoRARequest | None = None,
            kv_transfer_params: dict | None = None) -> list[EngineCoreRequest]:
    """Validate a request (n > 1: each of its n children, seeded seed + i) and register it with the output
    processor; all or nothing. Returns the engine requests: send [0] now; with n > 1 the others wait in the
    parent's `pending` until child 0 has computed the prompt (ParentRequest). kv_transfer_params: for the KV
    connector, given to child 0 alone (it moves the prompt's KV once; the other children find it in the prefix cache).

    Raises:
        InvalidRequestError: a bad prompt or parameter (nothing was registered).
    """
    if pooling_params is not None:  # a pooling request (params unused): one request, one vector
        request = input_processor.process_pooling(request_id, prompt_token_ids, pooling_params, arrival_time,
                                                   priority, cache_salt)
        output_processor.add_request(request, prompt, None, 0, "final_only")
        return [request]
    if params.n == 1:
        request = input_processor.process(request_id, prompt_token_ids, params, arrival_time, priority, cache_salt,
                                          lora_request, kv_transfer_params)
        output_processor.add_request(request, prompt, None, 0, output_kind)
        return [request]
    parent = ParentRequest(request_id, params.n)
    requests = [input_processor.process(parent.child_id(index), prompt_token_ids, child, arrival_time, priority,
                                        cache_salt, lora_request, kv_transfer_params if index == 0 else None)
                for index, child in enumerate(input_processor.child_params(params))]
    for index, request in enumerate(requests):
        output_processor.add_request(request, prompt, parent, index, output_kind)
    parent.pending = requests[1:]
    return requests

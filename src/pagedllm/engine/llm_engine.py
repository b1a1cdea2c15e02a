"""LLMEngine: the synchronous frontend over an in-process EngineCore (used by the offline LLM class).

Tokenize and validate -> EngineCore.step() -> detokenize and stop strings, with n > 1 fanned out to
sibling requests that share the prompt's blocks through the prefix cache.
"""

from __future__ import annotations

from pagedllm.config import EngineConfig
from pagedllm.engine.core import EngineCore
from pagedllm.engine.input_processor import InputProcessor
from pagedllm.engine.output_processor import OutputKind, OutputProcessor
from pagedllm.engine.parallel_sampling import fan_out
from pagedllm.messages import LoRARequest
from pagedllm.outputs import RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import get_tokenizer, tokenizer_source


class LLMEngine:
    def __init__(self, config: EngineConfig):
        if config.parallel_config.data_parallel_size > 1:
            raise ValueError("data_parallel_size above 1 needs `pagedllm serve` (N engine cores behind one API "
                             "server); the offline LLM runs one engine core. Use data_parallel_size=1.")
        self.config = config
        self.engine_core = EngineCore(config)
        self.tokenizer = get_tokenizer(tokenizer_source(config.model_config, self.engine_core.resolved_model))
        self.input_processor = InputProcessor(self.engine_core.model_limits(), self.tokenizer.eos_token_id,
                                              (config.model_config.served_model_name or
                                               [self.engine_core.resolved_model.name])[0])
        self.output_processor = OutputProcessor(self.tokenizer)

    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer.encode(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, cache_salt: str | None = None,
                    output_kind: OutputKind = "cumulative", pooling_params: PoolingParams | None = None,
                    lora_request: LoRARequest | None = None) -> None:
        """Validate, tokenize and queue one request (n > 1: n child requests).

        With pooling_params (runner pooling): an embedding request, `params` unused.

        Raises:
            InvalidRequestError: a bad prompt or parameter. QueueFullError: the waiting queue is full.
        """
        params = params or self.input_processor.default_sampling_params()
        prompt_text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        requests = fan_out(self.input_processor, self.output_processor, request_id, token_ids, params, prompt_text,
                           output_kind, priority=priority, cache_salt=cache_salt, pooling_params=pooling_params,
                           lora_request=lora_request)
        self.engine_core.add_request(requests[0])

    def abort_request(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(self.output_processor.abort_requests(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def step(self) -> list[RequestOutput]:
        outputs = self.engine_core.step()
        processed = self.output_processor.process_outputs(outputs)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        for request in processed.reqs_to_add:
            self.engine_core.add_request(request)
        return processed.request_outputs

    @property
    def num_preemptions(self) -> int:
        return self.engine_core.scheduler.num_preemptions

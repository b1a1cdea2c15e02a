"""The offline API: `LLM(model).generate(prompts, SamplingParams(...))`, batched by the scheduler."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.messages import LoRARequest
from pagedllm.outputs import EmbeddingRequestOutput, RequestOutput
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import SamplingParams

PromptType = str | list[int] | dict


class LLM:
    """An engine for offline batched generation.

    Args:
        model: a Hugging Face folder, a GGUF file, a hub id (`Qwen/Qwen3-8B`, `unsloth/Qwen3-0.6B-GGUF:Q4_K_M`; with
            revision= and download_dir=, as vLLM's), or None for the embedded SmolLM2-135M-Instruct.
        **engine_args: any field of ModelConfig, CacheConfig or SchedulerConfig (vLLM's names), e.g.
            max_num_seqs=64, max_num_batched_tokens=512, enable_prefix_caching=False, dtype="float32",
            enable_lora=True, max_loras=4.
    """

    def __init__(self, model: str | None = None, **engine_args: Any):
        self.llm_engine = LLMEngine(EngineConfig.from_kwargs(model=model, **engine_args))
        # As vLLM's LLM does (it zeroes its pool): the KV pool's pages are faulted in before the first batch, not
        # by its first writes or alongside its steps (worker/cpu_allocator.py; 4 GiB: ~2 s here).
        self.llm_engine.engine_core.wait_kv_cache_resident()
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix, as vLLM's LLM.reset_prefix_cache does (with KV events on, an
        AllBlocksCleared goes out). Returns False, changing nothing, while a request holds blocks."""
        return self.llm_engine.engine_core.reset_prefix_cache()

    def sleep(self, level: int = 1) -> None:
        """vLLM's LLM.sleep (needs enable_sleep_mode=True for levels 1 and 2): drop the weights and the KV pool,
        giving their memory back, until wake_up (engine/sleep_mode.py). Level 0 only pauses."""
        self.llm_engine.engine_core.sleep(level)  # no request is open between generate calls: nothing to abort

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """vLLM's LLM.wake_up: load the weights ("weights") and allocate the KV pool ("kv_cache") again; no tags:
        both. Returns whether the engine is fully awake."""
        awake = self.llm_engine.engine_core.wake_up(tags)
        if awake:
            self.llm_engine.engine_core.wait_kv_cache_resident()
        return awake

    def is_sleeping(self) -> bool:
        return self.llm_engine.engine_core.is_sleeping()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; returns one RequestOutput per prompt, in input order.

        Prompts may be strings, token-id lists, or {"prompt_token_ids": [...]} / {"prompt": "..."} dicts, which
        may also carry a "cache_salt" (vLLM's TokensPrompt / TextPrompt): prefix-cache hits only between requests
        with the same salt. `lora_request`: the LoRA adapter every prompt runs with, or one per prompt (None: the
        base model); needs enable_lora=True (vLLM's LoRARequest(lora_name, lora_int_id, lora_path)).
        """
        if self.llm_engine.engine_core.is_sleeping():
            raise RuntimeError("the engine is asleep: call LLM.wake_up() before generating.")
        if self.runner_type != "generate":  # vLLM's message
            raise ValueError("LLM.generate() is only supported for generative models. Try passing `--runner "
                             "generate` to use the model as a generative model.")
        prompts, salts = _as_prompt_list(prompts)
        if isinstance(sampling_params, Sequence):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"got {len(sampling_params)} SamplingParams for {len(prompts)} prompts")
            params_list = list(sampling_params)
        else:
            params_list = [sampling_params] * len(prompts)
        if isinstance(lora_request, Sequence):
            if len(lora_request) != len(prompts):
                raise ValueError(f"got {len(lora_request)} LoRA requests for {len(prompts)} prompts")
            loras = list(lora_request)
        else:
            loras = [lora_request] * len(prompts)
        request_ids = []
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                request_id = str(next(self._counter))
                self.llm_engine.add_request(request_id, prompt, params,
                                            priority=priority[i] if priority is not None else 0,
                                            output_kind="final_only", cache_salt=salts[i], lora_request=loras[i])
                request_ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(request_ids)
            raise
        return self._run_engine(request_ids, use_tqdm)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             chat_template: str | None = None) -> list[RequestOutput]:
        """Apply the chat template to one conversation or a list of them, then generate."""
        if self.runner_type != "generate":  # vLLM's message
            raise ValueError("LLM.chat() is only supported for generative models. Try passing `--runner generate` "
                             "to use the model as a generative model.")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts = [tokenizer.apply_chat_template(conv, tokenize=False, chat_template=chat_template,
                                                 add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final_message)
                   for conv in conversations]
        token_prompts = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        outputs = self.generate(token_prompts, sampling_params, use_tqdm=use_tqdm)
        for output, prompt in zip(outputs, prompts, strict=True):
            output.prompt = prompt
        return outputs

    @property
    def runner_type(self) -> str:
        """generate or pooling (--runner resolved by the engine)."""
        return self.llm_engine.engine_core.runner_type

    def embed(self, prompts: PromptType | Sequence[PromptType], use_tqdm: bool = True,
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order (vLLM's LLM.embed): `output.outputs.embedding`. Needs a pooling
        model (runner="pooling", or convert="embed"). pooling_params: `dimensions` (matryoshka models) and
        `use_activation` (normalise), one for all prompts or one per prompt; truncate_prompt_tokens: keep that many
        tokens of each prompt (-1: max_model_len)."""
        if self.runner_type != "pooling":  # vLLM's message
            raise ValueError("Embedding API is not supported by this model. Try converting the model using "
                             "`--convert embed`.")
        prompts, salts = _as_prompt_list(prompts)
        if truncate_prompt_tokens is not None:  # vLLM's: keep that many tokens (-1: max_model_len), tokenizer's side
            limit = truncate_prompt_tokens
            if limit == -1:
                limit = self.llm_engine.engine_core.max_model_len
            if limit < 1:
                raise ValueError(f"truncate_prompt_tokens must be -1 or positive, got {truncate_prompt_tokens}.")
            left = getattr(self.get_tokenizer(), "truncation_side", "right") == "left"
            prompts = [self.llm_engine.tokenize(p) if isinstance(p, str) else p for p in prompts]
            prompts = [p[-limit:] if left else p[:limit] for p in prompts]
        if isinstance(pooling_params, Sequence):
            if len(pooling_params) != len(prompts):
                raise ValueError(f"got {len(pooling_params)} PoolingParams for {len(prompts)} prompts")
            params_list = list(pooling_params)
        else:
            params_list = [pooling_params or PoolingParams()] * len(prompts)
        request_ids = []
        try:
            for prompt, params, salt in zip(prompts, params_list, salts, strict=True):
                request_id = str(next(self._counter))
                self.llm_engine.add_request(request_id, prompt, cache_salt=salt, output_kind="final_only",
                                            pooling_params=params)
                request_ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(request_ids)
            raise
        outputs = self._run_engine(request_ids, use_tqdm)
        for output in outputs:
            if output.error is not None:
                raise RuntimeError(output.error)
        return outputs

    encode = embed
    """vLLM's LLM.encode with pooling_task="embed" (the one task run)."""

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        finished: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True)
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output
                    if progress is not None:
                        progress.update(1)
        if progress is not None:
            progress.close()
        return [finished[r] for r in request_ids]


def _as_prompt_list(prompts) -> tuple[list[str | list[int]], list[str | None]]:
    """The prompts as strings or token-id lists, and each one's cache salt (None unless a dict gives one)."""
    if isinstance(prompts, str) or isinstance(prompts, dict):
        prompts = [prompts]
    elif prompts and isinstance(prompts[0], int):
        prompts = [prompts]
    result, salts = [], []
    for p in prompts:
        salt = None
        if isinstance(p, dict):
            salt = p.get("cache_salt")
            p = p["prompt_token_ids"] if "prompt_token_ids" in p else p["prompt"]
        result.append(p if isinstance(p, str) else list(p))
        salts.append(salt)
    return result, salts

"""POST /v1/embeddings (a server started with --runner pooling, or --convert embed, or on a sentence-transformers
folder): each input runs as one pooling request (engine/input_processor.py process_pooling); the vectors come back
as numbers or base64 (OpenAI's SDK asks for base64 by default and decodes little-endian float32)."""

from __future__ import annotations

import base64

import numpy as np

from pagedllm.engine.input_processor import is_valid_unicode
from pagedllm.entrypoints.openai import errors
from pagedllm.entrypoints.openai.embedding_protocol import (
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
    EmbeddingUsage,
)
from pagedllm.entrypoints.openai.protocol import MAX_REQUEST_ID_LEN, random_uuid
from pagedllm.entrypoints.openai.request_caps import too_many
from pagedllm.entrypoints.openai.serving_base import OpenAIServing, merge_streams
from pagedllm.outputs import EmbeddingRequestOutput
from pagedllm.pooling_params import PoolingParams

ENCODING_FORMATS = ("float", "base64")
EMBED_DTYPES = ("float32", "float16", "bfloat16")


class OpenAIServingEmbedding(OpenAIServing):
    async def create_embedding(self, request: EmbeddingRequest) -> EmbeddingResponse:
        """Validate, run every input, and answer with one vector per input, in order.

        Raises APIError for every rejection."""
        self.check_model(request.model)
        _check_fields(request)
        items = self._input_items(request)
        self.engine.check_admission(len(items))
        prompts = [await self._tokens(request, item) for item in items]
        params = PoolingParams(dimensions=request.dimensions, use_activation=request.use_activation)
        given = request.request_id
        if given is not None and not (0 < len(given) <= MAX_REQUEST_ID_LEN and is_valid_unicode(given)):
            raise errors.bad_request(f"request_id must be a non-empty string of at most {MAX_REQUEST_ID_LEN} "
                                     "characters of valid Unicode.", param="request_id")
        response_id = f"embd-{given or random_uuid()}"
        engine_id = f"{response_id}-{random_uuid()[:8]}"
        ids = [engine_id] if len(prompts) == 1 else [f"{engine_id}-{i}" for i in range(len(prompts))]
        streams = []
        try:
            for sub_id, (text, token_ids) in zip(ids, prompts, strict=True):
                streams.append(self.engine.add_request(sub_id, token_ids, None, text, "final_only", request.priority,
                                                       request.cache_salt, pooling_params=params))
        except BaseException:
            for sub_id in ids[:len(streams)]:
                self.engine.abort(sub_id)
            raise
        finals: dict[int, EmbeddingRequestOutput] = {}
        merged = merge_streams(streams)
        try:
            async for i, output in merged:
                finals[i] = output
        finally:
            await merged.aclose()
        data = [EmbeddingResponseData(index=i, embedding=_encode(finals[i].outputs.embedding, request))
                for i in range(len(prompts))]
        num_prompt = sum(len(finals[i].prompt_token_ids) for i in range(len(prompts)))
        return EmbeddingResponse(id=response_id, model=self.model_name, data=data,
                                 usage=EmbeddingUsage(prompt_tokens=num_prompt, total_tokens=num_prompt))

    def _input_items(self, request: EmbeddingRequest) -> list[str | list[int]]:
        value = request.input
        if isinstance(value, str):
            items: list = [value]
        elif isinstance(value, list) and value and all(_is_token_id(t) for t in value):
            items = [value]
        elif isinstance(value, list):
            items = list(value)
        else:
            items = []
        texts = all(isinstance(i, str) for i in items)
        if not items or not (texts or all(isinstance(i, list) and i and all(_is_token_id(t) for t in i)
                                          for i in items)):
            raise errors.bad_request("input must be a non-empty string, a list of strings, a list of token ids, or a "
                                     "list of lists of token ids.", param="input")
        if len(items) > self.config.max_prompts:
            raise too_many("prompt", len(items), self.config)
        if any(isinstance(i, str) and not is_valid_unicode(i) for i in items):
            raise errors.bad_request("input must be valid Unicode (no lone surrogates).", param="input")
        return items

    async def _tokens(self, request: EmbeddingRequest, item: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(item, str):
            if not item:
                raise errors.bad_request("input must not contain an empty string.", param="input")
            limit = request.truncate_prompt_tokens
            if limit is None:
                token_ids = await self.encode(item, request.add_special_tokens)
            else:  # truncated after tokenization: the text may be longer than max_model_len tokens
                token_ids = await self.tokenizer_threads.run(len(item), self.tokenizer.encode, item,
                                                             add_special_tokens=request.add_special_tokens)
            text = item
        else:
            token_ids, text = list(item), None
        return text, self._truncate(request, token_ids)

    def _truncate(self, request: EmbeddingRequest, token_ids: list[int]) -> list[int]:
        """vLLM's truncate_prompt_tokens: keep that many tokens (-1: max_model_len) on truncation_side's side."""
        limit = request.truncate_prompt_tokens
        if limit is None:
            return token_ids
        max_len = self.engine.max_model_len
        if limit == -1:
            limit = max_len
        if not 1 <= limit <= max_len:
            raise errors.bad_request(f"truncate_prompt_tokens ({limit}) must be -1 or in [1, max_model_len = "
                                     f"{max_len}].", param="truncate_prompt_tokens")
        side = request.truncation_side or getattr(self.tokenizer, "truncation_side", "right")
        return token_ids[-limit:] if side == "left" else token_ids[:limit]


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_fields(request: EmbeddingRequest) -> None:
    """The values that ask for what is not built: a 400 naming the field."""
    if request.encoding_format not in ENCODING_FORMATS:
        raise errors.bad_request(f"encoding_format {request.encoding_format!r} is not supported; supported: "
                                 f"{', '.join(ENCODING_FORMATS)}.", param="encoding_format")
    if request.embed_dtype not in EMBED_DTYPES:
        raise errors.bad_request(f"embed_dtype {request.embed_dtype!r} is not supported; supported: "
                                 f"{', '.join(EMBED_DTYPES)}.", param="embed_dtype")
    if request.padding == "max_length":
        raise errors.bad_request("padding 'max_length' is not supported (inputs are never padded).", param="padding")
    if request.mm_processor_kwargs:
        raise errors.bad_request("mm_processor_kwargs is not supported: this server runs text models.",
                                 param="mm_processor_kwargs")


def _encode(embedding: list[float], request: EmbeddingRequest) -> list[float] | str:
    if request.encoding_format == "float":
        return embedding
    values = np.asarray(embedding, dtype=np.float32)
    if request.embed_dtype == "float16":
        values = values.astype(np.float16)
    elif request.embed_dtype == "bfloat16":  # the top 16 bits, rounded to nearest even
        bits = values.view(np.uint32).astype(np.uint64)
        values = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    order = {"native": "=", "little": "<", "big": ">"}[request.endianness]
    return base64.b64encode(values.astype(values.dtype.newbyteorder(order)).tobytes()).decode("ascii")

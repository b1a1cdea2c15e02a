"""POST /tokenize and POST /detokenize, bounded as the generation routes are: a text that no tokenization fits in
max_model_len tokens, or a token list longer than max_model_len, is refused (400) before any tokenizer work, on the
raw body when it can be (`precheck`); messages render through the one path of /v1/chat/completions (chat_prompt.py);
the tokenizer work runs in the shared tokenizer threads (tokenizer_threads.py), where a big text never delays a
small one."""

from __future__ import annotations

from typing import Any

import msgspec

from pagedllm.config import ServerConfig
from pagedllm.engine.input_processor import is_valid_unicode
from pagedllm.entrypoints.openai import errors
from pagedllm.entrypoints.openai.chat_prompt import ChatPrompts
from pagedllm.entrypoints.openai.serving_base import OpenAIServing
from pagedllm.entrypoints.openai.tokenize_protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)

_RAW_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_RAW_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])
_TEXT = msgspec.json.Decoder(str)


class OpenAIServingTokenization(OpenAIServing):
    def __init__(self, *args, chat_prompts: ChatPrompts | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.chat_prompts = chat_prompts if chat_prompts is not None else ChatPrompts(self.tokenizer, self.config)
        """Shared with /v1/chat/completions (app.py): the same rendering, the same template child process."""

    def precheck(self, body: bytes, caps: ServerConfig) -> Any:
        """Refuse (400) a raw JSON body whose `prompt` is too long for max_model_len tokens however it tokenizes,
        or whose `tokens` list is longer than max_model_len, before the body is parsed into Python objects (a
        13.8 MB prompt or a 2.8-million-id list would take the event loop for a while). Returns None: the
        request's own parse and validation decide everything else (prechecked_route_class)."""
        try:
            fields = _RAW_FIELDS.decode(body)
        except msgspec.DecodeError:
            return None
        except RecursionError:
            raise errors.too_deep() from None
        raw = fields.get("prompt")
        if raw is not None and len(raw) > self.max_prompt_chars:  # else too few bytes for that many characters
            try:
                text = _TEXT.decode(raw)
            except msgspec.DecodeError:
                text = None  # not a string: validation answers it
            if text is not None:
                self.check_text_length(len(text))
        raw = fields.get("tokens")
        max_model_len = self.engine.max_model_len
        if raw is not None:
            data = bytes(raw)
            if data[:1] == b"[" and data.count(b",") >= max_model_len:  # else too few commas to be over
                try:
                    count = len(_RAW_ITEMS.decode(data))
                except msgspec.DecodeError:
                    return None
                if count > max_model_len:
                    raise too_many_tokens(count, max_model_len)
        return None

    async def tokenize(self, request: TokenizeRequest) -> str:
        """The TokenizeResponse's JSON. Raises APIError(400) as the generation routes refuse the same input."""
        self.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise errors.bad_request("Give exactly one of prompt and messages.", param="prompt")
        if request.messages is not None:
            if request.tools is not None and not request.tools:  # as /v1/chat/completions refuses it (ToolCalling)
                raise errors.bad_request("Invalid 'tools': empty array. Expected an array with minimum length 1 "
                                         "(leave tools out for no tools).", param="tools")
            tools = None if request.tools is None else [tool.model_dump(exclude_none=True) for tool in request.tools]
            text = await self.chat_prompts.render(request, tools)
            add_special = bool(request.add_special_tokens)
        else:
            text = request.prompt
            if not is_valid_unicode(text):
                raise errors.bad_request("prompt must be valid Unicode (no lone surrogates).", param="prompt")
            add_special = True if request.add_special_tokens is None else request.add_special_tokens
        token_ids = await self.encode(text, add_special)
        max_model_len = self.engine.max_model_len

        def response_json() -> str:  # a long token list's strings and JSON: in the tokenizer's thread too
            token_strs = self.tokenizer.convert_ids_to_tokens(token_ids) if request.return_token_strs else None
            return TokenizeResponse(count=len(token_ids), max_model_len=max_model_len, tokens=token_ids,
                                    token_strs=token_strs).model_dump_json()

        return await self.tokenizer_threads.run(len(text), response_json)

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        token_ids = request.tokens
        max_model_len = self.engine.max_model_len
        if len(token_ids) > max_model_len:
            raise too_many_tokens(len(token_ids), max_model_len)
        vocab_size = self.engine.input_processor.limits.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise errors.bad_request(f"Token id {bad} is out of vocabulary (size {vocab_size}).", param="tokens")
        text = await self.tokenizer_threads.run(len(token_ids), self.tokenizer.decode, token_ids)
        return DetokenizeResponse(prompt=text)


def too_many_tokens(count: int, max_model_len: int) -> errors.APIError:
    return errors.bad_request(f"tokens has {count} ids; this model's maximum context length is {max_model_len} "
                              "tokens.", param="tokens", code="context_length_exceeded")

"""vLLM's request logging: --enable-log-requests (each request as it arrives), --enable-log-outputs (each request's
output as it finishes) and --max-log-len (how much of a prompt or an output a line shows). vLLM's line formats."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence

from pagedllm.log_escape import escape_control
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

MAX_PARAMS_CHARS = 1000
"""The sampling parameters' repr is cut to this many characters (a request may carry large lists)."""


class RequestLogger:
    """Writes vLLM's request and output lines: ids, parameters, finish reasons and output text at INFO; prompt
    text and token ids at DEBUG. Prompts and outputs are cut to max_log_len characters (token ids: that many)."""

    def __init__(self, max_log_len: int | None):
        self.max_log_len = max_log_len

    def _cut(self, value):
        return value if value is None or self.max_log_len is None else value[:self.max_log_len]

    def log_inputs(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                   params: SamplingParams) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("Request %s details: prompt: %r, prompt_token_ids: %s, prompt_embeds shape: None.",
                         escape_control(request_id), self._cut(prompt), self._cut(prompt_token_ids))
        text = repr(params)
        if len(text) > MAX_PARAMS_CHARS:
            text = text[:MAX_PARAMS_CHARS] + "...)"
        logger.info("Received request %s: params: %s, lora_request: None.", escape_control(request_id),
                    escape_control(text))

    def log_outputs(self, request_id: str, text: str, token_ids: Sequence[int] | None, finish_reason: str | None,
                    is_streaming: bool) -> None:
        stream_info = " (streaming complete)" if is_streaming else ""
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("Generated response %s%s details: output_token_ids: %s", escape_control(request_id),
                         stream_info, self._cut(list(token_ids or [])))
        logger.info("Generated response %s%s: output: %r, finish_reason: %s", escape_control(request_id),
                    stream_info, self._cut(text), finish_reason)

    async def logging_outputs(self, stream: AsyncIterator[RequestOutput], request_id: str, n: int,
                              streaming: bool) -> AsyncIterator[RequestOutput]:
        """`stream`, passed through, with each choice's output logged when it finishes (a streamed one's pieces
        put together first; with n > 1 each choice as `{request_id}-{index}`). Closing this closes `stream` (which
        aborts the request when unfinished)."""
        texts: dict[int, list[str]] = {}
        token_ids: dict[int, list[int]] = {}
        try:
            async for output in stream:
                for completion in output.outputs:
                    if streaming:
                        texts.setdefault(completion.index, []).append(completion.text)
                        token_ids.setdefault(completion.index, []).extend(completion.token_ids)
                    if completion.finish_reason is None:
                        continue
                    if streaming:
                        text, ids = "".join(texts.pop(completion.index)), token_ids.pop(completion.index)
                    else:
                        text, ids = completion.text, list(completion.token_ids)
                    name = request_id if n == 1 else f"{request_id}-{completion.index}"
                    self.log_outputs(name, text, ids, completion.finish_reason, streaming)
                yield output
        finally:
            close = getattr(stream, "aclose", None)
            if close is not None:
                await close()

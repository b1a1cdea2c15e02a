"""The pieces of a response both endpoints write alike: usage, logprobs as JSON, and SSE framing."""

from __future__ import annotations

import json

from pydantic import BaseModel

from pagedllm.entrypoints.openai.errors import to_api_error
from pagedllm.entrypoints.openai.protocol import Logprob, PromptLogprobs, PromptTokensDetails, UsageInfo
from pagedllm.outputs import PositionLogprobs


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int | None) -> UsageInfo:
    """num_cached_tokens None: no prompt_tokens_details (vLLM's without --enable-prompt-tokens-details)."""
    details = None if num_cached_tokens is None else PromptTokensDetails(cached_tokens=num_cached_tokens)
    return UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=num_completion_tokens,
                     total_tokens=num_prompt_tokens + num_completion_tokens, prompt_tokens_details=details)


def token_id_text(token_id: int) -> str:
    """A token as --return-tokens-as-token-ids writes it in logprobs (vLLM's placeholder)."""
    return f"token_id:{token_id}"


def top_entries(position: PositionLogprobs, num: int) -> list[tuple[int, float, str]]:
    """The `num` most likely (token id, logprob, text) at one position, best first."""
    ranked = sorted(position.items(), key=lambda item: item[1].rank if item[1].rank is not None else 1 << 30)
    return [(tid, lp.logprob, lp.decoded_token or "") for tid, lp in ranked[:num]]


def json_logprob(logprob: float, logits: bool = False) -> float:
    """A logprob as the response carries it: at least -9999.0 (OpenAI's floor for -inf), at most 0.0, and never
    NaN (a degenerate distribution, e.g. a repetition_penalty that is 0.0 in float32, gives NaN logprobs: JSON
    cannot carry them, and rendering the response failed). logits (--logprobs-mode raw_logits or
    processed_logits): the value is a logit, floored and never NaN but not capped at 0."""
    if not logprob > -9999.0:
        return -9999.0
    return min(logprob, 9999.0) if logits else min(logprob, 0.0)


def prompt_logprobs_json(positions: list[PositionLogprobs | None] | None, num: int) -> PromptLogprobs | None:
    """vLLM's `prompt_logprobs` of a response: one entry per prompt token (None for the first), each the prompt
    token's logprob and rank plus the top `num`, logprobs floored at -9999.0 (vLLM's clamp)."""
    if positions is None:
        return None
    result: PromptLogprobs = []
    for position in positions:
        if position is None:
            result.append(None)
            continue
        entries = {}
        for i, (token_id, lp) in enumerate(position.items()):  # the prompt token first, then the top-N by rank
            if i == 0 or (lp.rank is not None and lp.rank <= num):
                entries[token_id] = Logprob(logprob=json_logprob(lp.logprob), rank=lp.rank,
                                            decoded_token=lp.decoded_token)
        result.append(entries)
    return result


def chosen_entry(position: PositionLogprobs, token_id: int) -> tuple[float, str]:
    lp = position.get(token_id)
    if lp is None:  # should not happen: the chosen token is always first
        return float("-inf"), ""
    return lp.logprob, lp.decoded_token or ""


def sse(chunk: BaseModel | dict) -> str:
    body = chunk.model_dump_json(exclude_unset=False) if isinstance(chunk, BaseModel) else json.dumps(chunk)
    return f"data: {body}\n\n"


def sse_error(e: BaseException) -> str:
    return sse({"error": to_api_error(e).to_info().model_dump()})


SSE_DONE = "data: [DONE]\n\n"

"""When a request stops: after each token the scheduler appends, as vLLM's check_stop does."""

from __future__ import annotations

from pagedllm.core.request import Request, RequestStatus


def append_and_check_stop(request: Request, new_token_ids: list[int], max_model_len: int) -> list[int]:
    """Append tokens one by one; return those kept (up to and including a stopping one)."""
    for i, token_id in enumerate(new_token_ids):
        request.append_output_token_id(token_id)
        if check_stop(request, token_id, max_model_len):
            return new_token_ids[:i + 1]
    return new_token_ids


def check_stop(request: Request, last_token_id: int, max_model_len: int) -> bool:
    """Set a finished status if the request must stop after `last_token_id`.

    EOS (unless ignore_eos) and stop_token_ids count only once min_tokens outputs exist; then
    max_tokens and max_model_len cap the length.
    """
    num_output_tokens = len(request.output_token_ids)
    params = request.sampling_params
    if num_output_tokens >= params.min_tokens:
        if last_token_id == request.eos_token_id and not params.ignore_eos:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if request.is_stop_token(last_token_id):
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
    max_tokens = request.max_tokens
    if ((max_tokens is not None and num_output_tokens >= max_tokens)
            or len(request.all_token_ids) >= max_model_len):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False

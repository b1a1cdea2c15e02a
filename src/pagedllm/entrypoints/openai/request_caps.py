"""The caps on one request's work (--max-n, --max-prompts, --max-choices, --max-logit-bias, --max-stop), checked
before anything is tokenized: `precheck_caps` on the raw JSON body, before it is even parsed into objects, and
`check_request_caps` on the validated request."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from pagedllm.config import ServerConfig
from pagedllm.entrypoints.openai import errors
from pagedllm.entrypoints.openai.protocol import SamplingFields


def n_above_cap(n: int, caps: ServerConfig) -> errors.APIError:
    return errors.bad_request(f"n must be in [1, {caps.max_n}], got {n}.", param="n")


def too_many(param: str, count: int, caps: ServerConfig) -> errors.APIError:
    """The error for a list (or logit_bias map) over its cap."""
    if param == "prompt":
        return errors.bad_request(f"prompt is a list of {count} prompts; at most {caps.max_prompts} are allowed "
                                  "in one request.", param="prompt")
    if param == "logit_bias":
        return errors.bad_request(f"logit_bias has {count} entries; at most {caps.max_logit_bias} are allowed.",
                                  param="logit_bias")
    if param == "stop":
        return errors.bad_request(f"stop has {count} strings; at most {caps.max_stop} are allowed.", param="stop")
    return errors.bad_request(f"{param} has {count} ids; at most {caps.max_stop} are allowed.", param=param)


def _cap_of(param: str, caps: ServerConfig) -> int:
    return {"prompt": caps.max_prompts, "logit_bias": caps.max_logit_bias}.get(param, caps.max_stop)


_CAPPED_LISTS = ("prompt", "stop", "stop_token_ids")
_RAW_FIELDS = msgspec.json.Decoder(dict[str, msgspec.Raw])
_RAW_ITEMS = msgspec.json.Decoder(list[msgspec.Raw])
_RAW_SMALL_INT = msgspec.json.Decoder(int)


def precheck_caps(body: bytes, caps: ServerConfig) -> Any:
    """Reject a JSON request body whose n, prompt list, stop list, stop_token_ids or logit_bias is over its cap,
    before the body is parsed into Python objects and validated (100,000 prompts cost ~100 ms to parse and
    validate; here ~10 ms: the body is scanned, not built).

    Raises the APIError of the first cap broken. Returns the parsed body when this had to parse it (a body
    msgspec refuses but Python's json reads: NaN, a lone surrogate), else None; the request's own parse and
    validation decide everything else."""
    try:
        fields = _RAW_FIELDS.decode(body)
    except msgspec.DecodeError:
        return _precheck_parsed(body, caps)
    except RecursionError:  # msgspec, like Python's json, gives up near the interpreter's recursion limit
        raise errors.too_deep() from None
    raw_n = fields.get("n")
    if raw_n is not None and len(raw_n) <= 24:
        try:
            n = _RAW_SMALL_INT.decode(raw_n)
        except msgspec.DecodeError:
            n = None
        if n is not None and not 1 <= n <= caps.max_n:
            raise n_above_cap(n, caps)
    for param in _CAPPED_LISTS:
        raw = fields.get(param)
        if raw is None:
            continue
        data = bytes(raw)
        cap = _cap_of(param, caps)
        if data[:1] != b"[" or data.count(b",") < cap:  # not a list, or too few commas for cap + 1 items
            continue
        first = data[1:].lstrip()[:1]
        if param == "prompt" and (first.isdigit() or first == b"-"):  # token ids: one prompt
            continue
        count = len(_RAW_ITEMS.decode(data))
        if count > cap:
            raise too_many(param, count, caps)
    raw = fields.get("logit_bias")
    if raw is not None:
        data = bytes(raw)
        if data[:1] == b"{" and data.count(b":") > caps.max_logit_bias:  # else too few colons to be over
            count = len(_RAW_FIELDS.decode(data))
            if count > caps.max_logit_bias:
                raise too_many("logit_bias", count, caps)
    return None


def _precheck_parsed(body: bytes, caps: ServerConfig) -> Any:
    try:
        data = json.loads(body)
    except ValueError:  # JSONDecodeError, bad UTF-8, an integer of too many digits
        return None  # the request's own parse answers it
    except RecursionError:
        raise errors.too_deep() from None
    if isinstance(data, dict):
        n = data.get("n")
        if isinstance(n, int) and not isinstance(n, bool) and not 1 <= n <= caps.max_n:
            raise n_above_cap(n, caps)
        for param in (*_CAPPED_LISTS, "logit_bias"):
            value = data.get(param)
            if param == "prompt" and isinstance(value, list) and value and isinstance(value[0], int):
                continue  # token ids: one prompt
            if isinstance(value, list | dict) and len(value) > _cap_of(param, caps):
                raise too_many(param, len(value), caps)
    return data


def check_request_caps(request: SamplingFields, caps: ServerConfig, num_prompts: int = 1) -> None:
    """The caps that bound one request's work, checked before any tokenization (each a serve flag)."""
    if not 1 <= request.n <= caps.max_n:
        raise n_above_cap(request.n, caps)
    if num_prompts * request.n > caps.max_choices:
        raise errors.bad_request(f"{num_prompts} prompts x n={request.n} are {num_prompts * request.n} choices; "
                                 f"at most {caps.max_choices} are allowed in one request (--max-choices).",
                                 param="n")
    if request.logit_bias is not None and len(request.logit_bias) > caps.max_logit_bias:
        raise too_many("logit_bias", len(request.logit_bias), caps)
    stop = [request.stop] if isinstance(request.stop, str) else (request.stop or [])
    if len(stop) > caps.max_stop:
        raise too_many("stop", len(stop), caps)
    if request.stop_token_ids is not None and len(request.stop_token_ids) > caps.max_stop:
        raise too_many("stop_token_ids", len(request.stop_token_ids), caps)

"""--override-generation-config (vLLM's flag): its JSON object parsed and checked once, for ModelConfig (the loader
merges it over the generation config's defaults: models/loader.py _apply_generation_config)."""

from __future__ import annotations

import json
from typing import Any

_GENERATION_OVERRIDE_TYPES = {"temperature": (int, float), "top_p": (int, float), "min_p": (int, float),
                              "repetition_penalty": (int, float), "top_k": (int,), "max_new_tokens": (int,)}


def parse_generation_overrides(value: str | dict | None) -> dict[str, Any] | None:
    """--override-generation-config's JSON object (or LLM(override_generation_config={...})); ValueError naming the
    flag where it is not an object or a sampling key's value is not a number (or null)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"--override-generation-config is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("--override-generation-config must be a JSON object such as '{\"temperature\": 0.5}'.")
    for key, kinds in _GENERATION_OVERRIDE_TYPES.items():
        v = value.get(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, kinds)):
            raise ValueError(f"--override-generation-config: {key} must be "
                             f"{'an integer' if kinds == (int,) else 'a number'} or null, got {v!r}.")
    return value

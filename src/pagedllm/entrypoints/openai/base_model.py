"""The base of every request and response model of the OpenAI-compatible API."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator

from pagedllm.log_escape import escape_control

logger = logging.getLogger(__name__)


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="wrap")
    @classmethod
    def _log_extra_fields(cls, data: Any, handler: Any) -> Any:
        """vLLM's: fields this server does not know are ignored, with a warning naming them."""
        result = handler(data)
        if isinstance(data, dict):
            known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
            extra = sorted(str(k) for k in data.keys() - known)
            if extra:
                logger.warning("The following fields were present in the request but ignored: %s",
                               escape_control(extra[:20])[:1000])
        return result

"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's routes, served only when
VLLM_ALLOW_RUNTIME_LORA_UPDATING is 1 or true: serving_models.runtime_lora_updating). Success is vLLM's plain-text
200 body; errors are OpenAI-shaped (400: a missing name or path, a name already loaded or a base model's, an adapter
that cannot be served; 404: no adapter at the path, or unloading a name not loaded)."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.responses import Response

from pagedllm.entrypoints.openai import errors
from pagedllm.entrypoints.openai.base_model import OpenAIBaseModel
from pagedllm.entrypoints.openai.openapi import error_responses
from pagedllm.entrypoints.openai.serving_models import ServingModels

logger = logging.getLogger(__name__)


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str | None = None
    lora_path: str | None = None
    load_inplace: bool = False
    """Replace an adapter of the same name (a new id: the engine loads the new weights on first use)."""
    is_3d_lora_weight: bool = False
    """vLLM's fused-MoE adapter layout switch: refused when true (no MoE LoRA here)."""


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str | None = None
    lora_int_id: int | None = None
    """Accepted, as vLLM accepts it; the adapter is found by its name."""


def add_lora_routes(app: FastAPI, models: ServingModels) -> None:
    logger.warning("LoRA dynamic loading & unloading is enabled in the API server (VLLM_ALLOW_RUNTIME_LORA_UPDATING). "
                   "This should ONLY be used for local development!")

    @app.post("/v1/load_lora_adapter", response_class=Response, responses=error_responses(400, 401, 404))
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        if body.is_3d_lora_weight:
            raise errors.bad_request("is_3d_lora_weight is not supported: adapters of fused mixture-of-experts "
                                     "weights are not served.", param="is_3d_lora_weight")
        return Response(models.load(body.lora_name, body.lora_path, load_inplace=body.load_inplace),
                        media_type="text/plain")

    @app.post("/v1/unload_lora_adapter", response_class=Response, responses=error_responses(400, 401, 404))
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        return Response(models.unload(body.lora_name), media_type="text/plain")

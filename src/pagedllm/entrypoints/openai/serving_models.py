"""The served models: the base model's names and the LoRA adapters (vLLM's OpenAIServingModels). A request names
either in `model`; /v1/models lists both, each adapter with `parent` = its base model and `root` = its folder.

Adapters come from --lora-modules at start-up and, when VLLM_ALLOW_RUNTIME_LORA_UPDATING is 1 or true (vLLM's
switch), from POST /v1/load_lora_adapter {"lora_name", "lora_path"} and /v1/unload_lora_adapter {"lora_name"}.
Each load gets a new lora_int_id (the engine loads its weights on first use and keeps --max-cpu-loras of them);
the adapter is checked against the model when loaded (lora/peft.py), so that a request never fails on it later.
"""

from __future__ import annotations

import itertools
import logging
from http import HTTPStatus

from pagedllm import envs
from pagedllm.config.lora import LoRAModulePath
from pagedllm.entrypoints.openai import errors
from pagedllm.entrypoints.openai.protocol import ModelCard
from pagedllm.lora.peft import LoRAAdapterError
from pagedllm.messages import LoRARequest

logger = logging.getLogger(__name__)


def runtime_lora_updating() -> bool:
    """vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: serve /v1/load_lora_adapter and /v1/unload_lora_adapter."""
    return envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING


class ServingModels:
    """`base_names`: the served model names (--served-model-name); `root`: the base model's path; `check`: the
    engine's adapter check (InputProcessor.check_lora), None when LoRA is off."""

    def __init__(self, base_names: list[str], root: str, check=None):
        self.base_names = base_names
        self.root = root
        self.check = check
        self.lora_requests: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    def load_static(self, modules: list[LoRAModulePath]) -> None:
        """--lora-modules at start-up; raises ValueError naming the first adapter that cannot be served."""
        if modules and self.check is None:
            raise ValueError("--lora-modules needs --enable-lora.")
        for module in modules:
            try:
                self.load(module.name, module.path, module.base_model_name)
            except errors.APIError as e:
                raise ValueError(f"--lora-modules {module.name}: {e.message}") from None

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter `model` names, None for the base model (or no name); raises APIError 404 for any other."""
        if not model or model in self.base_names:
            return None
        lora = self.lora_requests.get(model)
        if lora is None:
            raise errors.model_not_found(model)
        return lora

    def cards(self, max_model_len: int) -> list[ModelCard]:
        base = [ModelCard(id=name, root=self.root, max_model_len=max_model_len) for name in self.base_names]
        return base + [ModelCard(id=lora.lora_name, root=lora.lora_path,
                                 parent=lora.base_model_name or self.base_names[0])
                       for lora in self.lora_requests.values()]

    def load(self, lora_name: str | None, lora_path: str | None, base_model_name: str | None = None,
             load_inplace: bool = False) -> str:
        """Add an adapter (vLLM's checks and messages); raises APIError. Returns vLLM's success text."""
        if not lora_name or not lora_path:
            raise errors.bad_request("Both 'lora_name' and 'lora_path' must be provided.")
        if self.check is None:
            raise errors.bad_request("LoRA is not enabled: start the server with --enable-lora.")
        if lora_name in self.base_names:
            raise errors.bad_request(f"The lora adapter '{lora_name}' conflicts with a served base model.")
        if not load_inplace and lora_name in self.lora_requests:
            raise errors.bad_request(f"The lora adapter '{lora_name}' has already been loaded. If you want to load "
                                     "the adapter in place, set 'load_inplace' to True.")
        base = base_model_name if base_model_name in self.base_names else None
        lora = LoRARequest(lora_name, next(self._ids), lora_path, base)
        try:
            self.check(lora)
        except LoRAAdapterError as e:
            kind = "NotFoundError" if e.status_code == HTTPStatus.NOT_FOUND else "BadRequestError"
            raise errors.APIError(HTTPStatus(e.status_code), str(e), kind) from None
        self.lora_requests[lora_name] = lora
        logger.info("Loaded new LoRA adapter: name '%s', path '%s'", lora_name, lora_path)
        return f"Success: LoRA adapter '{lora_name}' added successfully."

    def unload(self, lora_name: str | None) -> str:
        if not lora_name:
            raise errors.bad_request("'lora_name' needs to be provided to unload a LoRA adapter.")
        if lora_name not in self.lora_requests:
            raise errors.APIError(HTTPStatus.NOT_FOUND, f"The lora adapter '{lora_name}' cannot be found.",
                                  "NotFoundError")
        del self.lora_requests[lora_name]
        logger.info("Removed LoRA adapter: name '%s'", lora_name)
        return f"Success: LoRA adapter '{lora_name}' removed successfully."

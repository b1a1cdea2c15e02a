"""The tokenizer of an HF folder (tokenizer.json + tokenizer_config.json / chat_template.jinja) or of a
GGUF file (vocabulary, merges, special tokens and chat template from its metadata).

transformers builds both; it never runs model-supplied code here (trust_remote_code is always False)
and renders chat templates in jinja2's ImmutableSandboxedEnvironment.
"""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerFast

from pagedllm.models.loader import ResolvedModel, resolve_model
from pagedllm.models.model_info import ModelLoadError


def get_tokenizer(model: ResolvedModel | str | Path | None) -> PreTrainedTokenizerFast:
    """Load the tokenizer for a resolved model, a model argument, or a tokenizer-only folder.

    Raises ModelLoadError naming the path when it cannot be loaded.
    """
    if not isinstance(model, ResolvedModel):
        path = Path(model) if model is not None else None
        if path is not None and path.is_dir() and (path / "tokenizer.json").is_file():
            model = ResolvedModel("hf", path, str(model))
        else:
            model = resolve_model(None if model is None else str(model))
    kwargs = {"trust_remote_code": False, "local_files_only": True}
    try:
        if model.kind == "gguf":
            tokenizer = AutoTokenizer.from_pretrained(str(model.folder), gguf_file=model.path.name, **kwargs)
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(model.path), **kwargs)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... on bad files
        raise ModelLoadError(f"{model.path}: cannot load tokenizer ({type(e).__name__}: {e})") from None
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ModelLoadError(f"{model.path}: only fast (tokenizers) tokenizers are supported, "
                             f"got {type(tokenizer).__name__}")
    return tokenizer

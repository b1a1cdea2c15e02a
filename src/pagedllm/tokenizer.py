"""The tokenizer of an HF folder (tokenizer.json + tokenizer_config.json / chat_template.jinja) or of a
GGUF file (vocabulary, merges, special tokens and chat template from its metadata).

transformers builds both; it never runs model-supplied code here (trust_remote_code is always False)
and renders chat templates in jinja2's ImmutableSandboxedEnvironment.

For a GGUF file, `AutoTokenizer.from_pretrained(gguf_file=...)` also builds a model config, which walks
the whole file with gguf's slow reader and imports transformers' modeling stack (~10 s on a 2-core CPU).
The tokenizer needs none of that: we read the metadata with our own reader and hand it to the same
transformers converter AutoTokenizer uses (`convert_gguf_tokenizer`), so the result is the same
tokenizer in well under a second (tests/models/test_tokenizer.py compares them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from pagedllm.models.model_info import ModelLoadError
from pagedllm.models.resolve import ResolvedModel, resolve_model, tokenizer_source  # noqa: F401 (re-exported)

# GGUF metadata key -> transformers' name, as transformers' get_gguf_tokenizer maps them.
_GGUF_TOKENIZER_KEYS = {
    "tokenizer.ggml.model": "tokenizer_type", "tokenizer.ggml.pre": "pre_tokenizer_type",
    "tokenizer.ggml.tokens": "tokens", "tokenizer.ggml.scores": "scores",
    "tokenizer.ggml.token_type": "token_type", "tokenizer.ggml.merges": "merges",
    "tokenizer.ggml.precompiled_charsmap": "precompiled_charsmap",
    "tokenizer.ggml.bos_token_id": "bos_token_id", "tokenizer.ggml.eos_token_id": "eos_token_id",
    "tokenizer.ggml.unknown_token_id": "unk_token_id", "tokenizer.ggml.padding_token_id": "pad_token_id",
    "tokenizer.ggml.add_space_prefix": "add_prefix_space",
}
_GGUF_CONFIG_KEYS = {"tokenizer.chat_template": "chat_template", "tokenizer.ggml.add_bos_token": "add_bos_token",
                     "tokenizer.ggml.add_eos_token": "add_eos_token"}
_GGUF_SPECIAL_TOKENS = {"bos_token": "tokenizer.ggml.bos_token_id", "eos_token": "tokenizer.ggml.eos_token_id",
                        "unk_token": "tokenizer.ggml.unknown_token_id",
                        "pad_token": "tokenizer.ggml.padding_token_id"}


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
            tokenizer = _gguf_tokenizer(model)
        else:
            from transformers import AutoTokenizer  # imports torch (transformers' config stack): only here

            tokenizer = AutoTokenizer.from_pretrained(str(model.path), **kwargs)
    except ModelLoadError:
        raise
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... on bad files
        raise ModelLoadError(f"{model.path}: cannot load tokenizer ({type(e).__name__}: {e})") from None
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise ModelLoadError(f"{model.path}: only fast (tokenizers) tokenizers are supported, "
                             f"got {type(tokenizer).__name__}")
    return tokenizer


def _gguf_tokenizer(model: ResolvedModel) -> PreTrainedTokenizerFast:
    """What AutoTokenizer.from_pretrained(folder, gguf_file=name) returns, without its config pass."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    from pagedllm.models.gguf_loader import open_gguf

    metadata = open_gguf(model.path).metadata
    architecture, tokenizer_dict, config = gguf_tokenizer_inputs(metadata)
    backend, extra = convert_gguf_tokenizer(architecture, tokenizer_dict)
    return PreTrainedTokenizerFast(tokenizer_object=backend, name_or_path=str(model.folder), **config, **extra)


def gguf_tokenizer_inputs(metadata: dict[str, Any]) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(architecture, tokenizer_dict, tokenizer_config) as transformers' get_gguf_tokenizer builds them."""
    tokenizer = {name: metadata[key] for key, name in _GGUF_TOKENIZER_KEYS.items() if key in metadata}
    config = {name: metadata[key] for key, name in _GGUF_CONFIG_KEYS.items() if key in metadata}
    tokenizer_type = tokenizer.get("tokenizer_type")
    if tokenizer_type == "llama":  # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise
        config.setdefault("add_bos_token", True)
    elif tokenizer_type == "gemma4":  # the chat template writes <bos> itself
        config["add_bos_token"] = False
    for name, key in _GGUF_SPECIAL_TOKENS.items():
        token_id = metadata.get(key)
        config[name] = tokenizer["tokens"][token_id] if token_id is not None else None
    return metadata["general.architecture"], tokenizer, config

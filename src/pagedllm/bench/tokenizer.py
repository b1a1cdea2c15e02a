"""Load the benchmark client's tokenizer from a Hugging Face folder, a hub name or a GGUF file."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def get_tokenizer(name_or_path: str, trust_remote_code: bool = False):
    """Return a transformers tokenizer for `name_or_path`.

    Accepts a Hugging Face folder, a `.gguf` file (its embedded tokenizer is read through transformers'
    `gguf_file=`), or a folder that holds no tokenizer files but exactly one `.gguf` file.

    Raises:
        ValueError: when nothing loadable is found, naming the path so the user can pass `--tokenizer`.
    """
    from transformers import AutoTokenizer

    folder, gguf_file = _split_gguf(name_or_path)
    kwargs = {"trust_remote_code": trust_remote_code}
    if gguf_file is not None:
        kwargs["gguf_file"] = gguf_file
    try:
        return AutoTokenizer.from_pretrained(folder, **kwargs)
    except (OSError, ValueError) as e:
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

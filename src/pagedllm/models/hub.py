"""Models named by Hugging Face hub id, as vLLM users name them: `Qwen/Qwen3-8B`, or a GGUF repo in vLLM's
`repo_id:quant_type` style (`unsloth/Qwen3-0.6B-GGUF:Q4_K_M`), or a repo holding one .gguf file.

They are found in, or downloaded to, the Hugging Face cache by huggingface_hub, as vLLM does: HF_HOME and
HF_HUB_CACHE say where the cache is, HF_HUB_OFFLINE=1 keeps to it, HF_ENDPOINT and HF_TOKEN are huggingface_hub's,
--revision picks a branch, tag or commit, and --download-dir replaces the cache folder. Only what a model needs is
downloaded: config and tokenizer files, generation_config.json, the chat template and the safetensors weights (the
shards its index names, where it has one; never `original/`, never pickles), or the one GGUF file. When the hub
cannot be reached, the cached snapshot is used; when there is none, ModelLoadError says in one line what is missing
and where it looked.

Imports neither torch nor transformers (the API server resolves the model before the engine core starts).
"""

from __future__ import annotations

import fnmatch
import json
import re
import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from pagedllm.models.model_info import ModelLoadError

_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")
_REMOTE_GGUF = re.compile(r"([a-zA-Z0-9][a-zA-Z0-9._-]*/[a-zA-Z0-9][a-zA-Z0-9._-]*):([A-Za-z0-9_+-]+)")
"""vLLM's `repo_id:quant_type` (vllm/transformers_utils/gguf_utils.py is_remote_gguf)."""
_GGUF_QUANT_SUFFIXES = ("_M", "_S", "_L", "_XL", "_XS", "_XXS")
"""Quant type names past GGML's own (Q4_K_M is a Q4_K file): vLLM's list."""
_SPLIT_GGUF = re.compile(r".*-\d{5}-of-\d{5}\.gguf")

MODEL_FILES = ("*.json", "*.safetensors", "*.jinja", "tokenizer.model", "merges.txt", "vocab.txt")
"""The top-level files of a Hugging Face model repo that are downloaded (config.json, generation_config.json,
tokenizer.json, tokenizer_config.json, special_tokens_map.json, chat_template.jinja, the weights and their index).
Not additional_chat_templates/: with it transformers makes the tokenizer's chat_template a dict of named templates,
which the chat route does not pick from yet; chat_template.jinja is the default one."""
TOKENIZER_FILES = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                   "chat_template.json", "*.jinja", "config.json")
"""What --tokenizer REPO downloads (config.json: AutoTokenizer reads the model type there)."""
_INDEX = "model.safetensors.index.json"


def is_hub_id(model: str) -> bool:
    """Whether `model` can name a hub repo (`org/name`, `name`, or `org/name:QUANT`); the caller has already found no
    local path of that name."""
    return bool(_REPO_ID.fullmatch(model) or _REMOTE_GGUF.fullmatch(model))


def split_remote_gguf(model: str) -> tuple[str, str | None]:
    """(repo_id, quant_type) of vLLM's `repo_id:quant_type`; (model, None) for a plain repo id. A known GGML type
    (`Q8_0`, `Q4_K`) or one with a size suffix (`Q4_K_M`) is a quant type; anything else is refused."""
    match = _REMOTE_GGUF.fullmatch(model)
    if match is None:
        return model, None
    repo, quant = match.groups()
    from gguf.constants import GGMLQuantizationType  # numpy, no torch; only for this form

    names = GGMLQuantizationType.__members__
    if quant not in names and not any(quant.endswith(s) and quant[:-len(s)] in names for s in _GGUF_QUANT_SUFFIXES):
        raise ModelLoadError(f"model {model!r}: {quant!r} is not a GGUF quant type (repo_id:quant_type, e.g. "
                             f"{repo}:Q4_K_M; types: {', '.join(names)}, optionally with a suffix "
                             f"{', '.join(_GGUF_QUANT_SUFFIXES)})")
    return repo, quant


def _gguf_file(files: Iterable[str], quant: str | None, where: str) -> str | None:
    """The GGUF file vLLM picks for `quant` (get_gguf_file_path_from_hf: `*-QUANT.gguf` or `*-QUANT-*.gguf`, at the
    top or one folder down, fewest dashes first); without a quant type, the repo's only .gguf file (None if none)."""
    files = [f for f in files if f.endswith(".gguf")]
    if quant is None:
        if len(files) > 1:
            raise ModelLoadError(f"{where}: {len(files)} .gguf files ({', '.join(sorted(files)[:4])}...); name one "
                                 f"with repo_id:quant_type, as vLLM takes it")
        return files[0] if files else None
    patterns = (f"*-{quant}.gguf", f"*-{quant}-*.gguf", f"*/*-{quant}.gguf", f"*/*-{quant}-*.gguf")
    matching = sorted((f for f in files if any(fnmatch.fnmatch(f, p) for p in patterns)),
                      key=lambda f: (f.count("-"), f))
    if not matching:
        raise ModelLoadError(f"{where}: no GGUF file of quant type {quant} (looked for {', '.join(patterns)} among "
                             f"{len(files)} .gguf files)")
    if _SPLIT_GGUF.fullmatch(matching[0]):
        raise ModelLoadError(f"{where}: {matching[0]} is one part of a split GGUF model; only single-file GGUF "
                             f"models are loaded (merge the parts with llama.cpp's gguf-split --merge)")
    return matching[0]


def _model_files(files: Iterable[str], quant: str | None, read_index: Callable[[], dict], where: str) -> list[str]:
    """The files of a repo listing to load: one GGUF file, or config, tokenizer and safetensors files ([] if the
    listing has neither a config.json nor a .gguf file)."""
    files = list(files)
    if quant is not None or "config.json" not in files:
        gguf = _gguf_file(files, quant, where)
        return [gguf] if gguf else []
    top = [f for f in files if "/" not in f and any(fnmatch.fnmatch(f, p) for p in MODEL_FILES)]
    if _INDEX in top:  # only the shards the index names (a repo may also hold consolidated.safetensors)
        shards = set(read_index().get("weight_map", {}).values())
        top = [f for f in top if not f.endswith(".safetensors") or f in shards] + sorted(shards - set(top))
    return top


def _tokenizer_files(files: Iterable[str]) -> list[str]:
    return [f for f in files if "/" not in f and any(fnmatch.fnmatch(f, p) for p in TOKENIZER_FILES)]


_resolved: dict[tuple, Path] = {}
_lock = threading.Lock()


def hub_model_path(model: str, revision: str | None = None, download_dir: str | None = None,
                   tokenizer_only: bool = False) -> Path:
    """The local path of a hub model (its snapshot folder, or its GGUF file), downloading what is missing when the
    hub can be reached; with tokenizer_only, the snapshot folder holding the repo's tokenizer files only. A path
    once found is kept for the life of the process (the engine core asks several times)."""
    from huggingface_hub import constants

    repo, quant = split_remote_gguf(model)
    cache_dir = str(Path(download_dir).expanduser() if download_dir else Path(constants.HF_HUB_CACHE))
    key = (model, revision, cache_dir, tokenizer_only, constants.HF_HUB_OFFLINE, constants.ENDPOINT)
    with _lock:
        if key not in _resolved:
            _resolved[key] = _find(repo, quant, model, revision, cache_dir, tokenizer_only)
        return _resolved[key]


def _find(repo: str, quant: str | None, model: str, revision: str | None, cache_dir: str,
          tokenizer_only: bool) -> Path:
    """The files from the hub (downloaded where missing), or, where it cannot or will not answer, from the cache."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import (
        GatedRepoError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    where = f"{repo} (revision {revision or 'main'})"
    if constants.HF_HUB_OFFLINE:
        return _from_cache(repo, quant, model, revision, cache_dir, tokenizer_only, "HF_HUB_OFFLINE is set")
    try:
        listing = [s.rfilename for s in HfApi().model_info(repo, revision=revision).siblings or []]
    except (RepositoryNotFoundError, GatedRepoError) as e:  # as huggingface_hub does, an earlier snapshot still serves
        why = (f"the hub {constants.ENDPOINT} has no repo {repo} that this client may read ({type(e).__name__}; a "
               f"private or gated repo needs HF_TOKEN)")
    except RevisionNotFoundError:
        raise ModelLoadError(f"model {model!r}: the hub {constants.ENDPOINT} has repo {repo} but no revision "
                             f"{revision!r}") from None
    except Exception as e:  # noqa: BLE001 (the HTTP client's errors differ between huggingface_hub versions)
        why = f"the hub {constants.ENDPOINT} cannot be reached ({type(e).__name__}: {_one_line(e, 200)})"
    else:
        return _download(repo, quant, revision, cache_dir, tokenizer_only, listing, where)
    return _from_cache(repo, quant, model, revision, cache_dir, tokenizer_only, why)


def _one_line(e: Exception, limit: int) -> str:
    return " ".join(str(e).split())[:limit]


def _download(repo: str, quant: str | None, revision: str | None, cache_dir: str, tokenizer_only: bool,
              listing: list[str], where: str) -> Path:
    """What the model needs of the hub's listing, into the cache (huggingface_hub skips what is there already)."""
    from huggingface_hub import constants, hf_hub_download, snapshot_download

    def read_index() -> dict:
        return json.loads(Path(hf_hub_download(repo, _INDEX, revision=revision, cache_dir=cache_dir)).read_text())

    files = _tokenizer_files(listing) if tokenizer_only else _model_files(listing, quant, read_index, f"repo {where}")
    if not files:
        raise ModelLoadError(f"repo {where} on {constants.ENDPOINT} has no "
                             + ("tokenizer files" if tokenizer_only else "config.json nor .gguf file"))
    try:
        folder = Path(snapshot_download(repo, revision=revision, cache_dir=cache_dir, allow_patterns=files))
    except Exception as e:  # noqa: BLE001 (a failed download: one line, not a traceback from the engine core)
        raise ModelLoadError(f"downloading {', '.join(files)} of {where} from {constants.ENDPOINT} to {cache_dir} "
                             f"failed ({type(e).__name__}: {_one_line(e, 300)})") from None
    return folder if tokenizer_only or not files[0].endswith(".gguf") else folder / files[0]


def _from_cache(repo: str, quant: str | None, model: str, revision: str | None, cache_dir: str,
                tokenizer_only: bool, why: str) -> Path:
    """The cached snapshot of the revision, checked for what the model needs; `why`: why the hub was not asked."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    where = f"{repo} (revision {revision or 'main'})"
    storage = Path(cache_dir) / ("models--" + repo.replace("/", "--"))
    try:  # the snapshot folder of the revision (refs/<branch> or snapshots/<commit>), whatever it holds
        folder = Path(snapshot_download(repo, revision=revision, cache_dir=cache_dir, local_files_only=True,
                                        allow_patterns=["config.json"] if not tokenizer_only and quant is None
                                        else ["tokenizer_config.json"]))
    except (LocalEntryNotFoundError, OSError, ValueError):
        raise ModelLoadError(f"model {model!r} is not a local path and {why}; the Hugging Face cache {cache_dir} "
                             f"has no snapshot of {where} (looked in {storage}); download it with the hub "
                             f"reachable, or set HF_HUB_CACHE / --download-dir to the cache that has it") from None
    local = sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())
    cached = f"the cached snapshot {folder} of {where}"
    if tokenizer_only:
        if not {"tokenizer.json", "tokenizer_config.json"} & set(local):
            raise ModelLoadError(f"{why}, and {cached} has no tokenizer.json or tokenizer_config.json")
        return folder

    def read_index() -> dict:
        try:
            return json.loads((folder / _INDEX).read_text())
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{folder / _INDEX}: cannot read the weights index ({e})") from None

    files = _model_files(local, quant, read_index, cached)
    if not files:
        raise ModelLoadError(f"{why}, and {cached} has neither a config.json nor a .gguf file")
    if files[0].endswith(".gguf"):
        return folder / files[0]
    missing = [f for f in files if not (folder / f).is_file()]
    if not any(f.endswith(".safetensors") for f in files):
        missing.append("*.safetensors")
    if missing:
        raise ModelLoadError(f"{why}, and {cached} is incomplete: missing {', '.join(missing)}")
    return folder

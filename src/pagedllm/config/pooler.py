"""--runner, --convert and --pooler-config (vLLM 0.32's names and meanings), resolved against the model folder.

runner auto is `pooling` when --convert asks for a pooling adapter (embed) or the folder is a sentence-transformers
model (it has a modules.json), else `generate` (every family pagedllm runs is a text-generation model). The pooling
type comes from --pooler-config, else from the sentence-transformers Pooling module's config.json
(`pooling_mode_mean_tokens`, `pooling_mode_cls_token`, `pooling_mode_lasttoken`, or `pooling_mode`), else LAST (vLLM's
default for a converted decoder model); embeddings are L2-normalised unless --pooler-config's use_activation is
false or a sentence-transformers folder has no Normalize module.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, fields
from typing import Any

from pagedllm.pooling_params import SEQ_POOLING_TYPES, PoolerDefaults

logger = logging.getLogger(__name__)

RUNNERS = ("auto", "draft", "generate", "pooling")
CONVERTS = ("auto", "classify", "embed", "none")
_ST_POOLING = {"sentence_transformers.models.Pooling",
               "sentence_transformers.sentence_transformer.modules.pooling.Pooling"}
_ST_NORMALIZE = {"sentence_transformers.models.Normalize", "sentence_transformers.base.modules.normalize.Normalize",
                 "sentence_transformers.sentence_transformer.modules.normalize.Normalize"}
_REFUSED_KEYS = {
    "task": "only the embed task runs", "tok_pooling_type": "token-wise pooling (ALL, STEP) is not built",
    "enable_chunked_processing": "long inputs past max_model_len are refused instead",
    "max_embed_len": "long inputs past max_model_len are refused instead",
    "logit_mean": "classification is not built", "logit_sigma": "classification is not built",
    "step_tag_id": "reward models are not built", "returned_token_ids": "reward models are not built",
}


@dataclass
class PoolerConfig:
    """vLLM's PoolerConfig, the keys pagedllm honours; the others are refused naming the key."""

    pooling_type: str | None = None
    seq_pooling_type: str | None = None
    use_activation: bool | None = None
    dimensions: int | None = None
    enable_flash_late_interaction: bool = True  # accepted: a CUDA kernel choice, no effect here

    def __post_init__(self) -> None:
        if self.pooling_type is not None:
            if self.seq_pooling_type is not None:
                raise ValueError("--pooler-config: cannot set both `pooling_type` and `seq_pooling_type`")
            if self.pooling_type in ("ALL", "STEP"):
                raise ValueError(f"--pooler-config: pooling_type {self.pooling_type!r} (token-wise pooling) is not "
                                 f"supported by pagedllm; supported: {', '.join(SEQ_POOLING_TYPES)}.")
            self.seq_pooling_type = self.pooling_type
        if self.seq_pooling_type is not None and self.seq_pooling_type not in SEQ_POOLING_TYPES:
            raise ValueError(f"--pooler-config: pooling type {self.seq_pooling_type!r} is not one of "
                             f"{', '.join(SEQ_POOLING_TYPES)}.")
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise ValueError(f"--pooler-config: dimensions must be a positive integer, got {self.dimensions!r}.")

    @classmethod
    def parse(cls, value: str | dict | PoolerConfig | None) -> PoolerConfig | None:
        if value is None or isinstance(value, PoolerConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--pooler-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("--pooler-config must be a JSON object such as '{\"pooling_type\": \"MEAN\"}'.")
        if "normalize" in value:  # vLLM 0.32's message
            raise ValueError("--pooler-config: Parameter `normalize` was removed; use `use_activation` instead.")
        for key in value:
            if key in _REFUSED_KEYS and value[key] is not None:
                raise ValueError(f"--pooler-config: {key} is not supported by pagedllm ({_REFUSED_KEYS[key]}).")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known - set(_REFUSED_KEYS))
        if unknown:
            raise ValueError(f"unknown --pooler-config keys: {', '.join(unknown)}.")
        return cls(**{k: v for k, v in value.items() if k in known})


def check_runner(runner: str, convert: str) -> None:
    """Refuse the --runner and --convert values pagedllm does not run, naming them."""
    if runner not in RUNNERS:
        raise ValueError(f"--runner must be one of {', '.join(RUNNERS)}; got {runner!r}.")
    if runner == "draft":
        raise ValueError("--runner draft is not supported by pagedllm (a draft model runs inside "
                         "--speculative-config); use --runner auto, generate or pooling.")
    if convert not in CONVERTS:
        raise ValueError(f"--convert must be one of {', '.join(CONVERTS)}; got {convert!r}.")
    if convert == "classify":
        raise ValueError("--convert classify is not supported by pagedllm (no classification head is built); "
                         "use --convert auto, none or embed.")
    if runner == "generate" and convert == "embed":
        raise ValueError("This model does not support `--runner generate` with `--convert embed`; use --runner "
                         "pooling (or auto) to serve embeddings.")
    if runner == "pooling" and convert == "none":  # vLLM's message: a generative model needs an adapter to pool
        raise ValueError("This model does not support `--runner pooling`. You can pass `--convert <embed|classify> "
                         "to adapt it into a pooling model.")


def runner_type(runner: str, convert: str, model_dir: str | None) -> str:
    """`generate` or `pooling` (vLLM's _get_runner_type)."""
    if runner != "auto":
        return runner
    if convert == "embed" or sentence_transformers_modules(model_dir) is not None:
        logger.info("Resolved `--runner auto` to `--runner pooling`. Pass the value explicitly to silence this "
                    "message.")
        return "pooling"
    return "generate"


def sentence_transformers_modules(model_dir: str | None) -> list[dict] | None:
    path = os.path.join(model_dir, "modules.json") if model_dir and os.path.isdir(model_dir) else None
    if path is None or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            modules = json.load(f)
    except (OSError, ValueError):
        logger.warning("%s is not valid JSON; ignored", path)
        return None
    return modules if isinstance(modules, list) else None


def sentence_transformers_pooling(model_dir: str | None) -> dict[str, Any]:
    """{seq_pooling_type, use_activation} read from a sentence-transformers folder, as vLLM's get_pooling_config
    reads them ({} for another folder)."""
    modules = sentence_transformers_modules(model_dir)
    if modules is None:
        return {}
    items = [m for m in modules if isinstance(m, dict)]
    result: dict[str, Any] = {"use_activation": any(m.get("type") in _ST_NORMALIZE for m in items)}
    pooling = next((m for m in items if m.get("type") in _ST_POOLING), None)
    if pooling is None:
        return result
    try:
        with open(os.path.join(model_dir, str(pooling.get("path", "")), "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError):
        config = {}
    for key, value in (config.items() if isinstance(config, dict) else ()):
        if key == "pooling_mode" and isinstance(value, str):
            name = value
        elif value is True:
            name = key
        else:
            continue
        name = name.replace("pooling_mode_", "").split("_", 1)[0]
        name = "LAST" if "lasttoken" in name else name.upper()
        if name in SEQ_POOLING_TYPES:
            result["seq_pooling_type"] = name
    return result


def resolve_pooler(config: PoolerConfig | None, model_dir: str | None, hf_config: dict[str, Any],
                   hidden_size: int) -> PoolerDefaults:
    """The pooling the engine applies: --pooler-config's keys first, then the sentence-transformers folder's, then
    LAST with normalisation (vLLM's order)."""
    config = config or PoolerConfig()
    found = sentence_transformers_pooling(model_dir)
    pooling_type = config.seq_pooling_type or found.get("seq_pooling_type") or "LAST"
    use_activation = config.use_activation if config.use_activation is not None else found.get("use_activation", True)
    dims = hf_config.get("matryoshka_dimensions")
    defaults = PoolerDefaults(pooling_type=pooling_type, use_activation=bool(use_activation),
                              embedding_size=hidden_size,
                              is_matryoshka=bool(dims) or bool(hf_config.get("is_matryoshka", False)),
                              matryoshka_dimensions=list(dims) if isinstance(dims, list) else None,
                              dimensions=config.dimensions)
    logger.info("Pooling: %s, normalize=%s, embedding size %d%s", pooling_type, defaults.use_activation, hidden_size,
                " (matryoshka)" if defaults.is_matryoshka else "")
    return defaults


def wrong_runner_message(runner: str) -> str:
    """Why a request of the other kind is refused (vLLM's words for LLM.generate and LLM.embed)."""
    if runner == "pooling":
        return ("Text generation is only supported for generative models. Try passing `--runner generate` to use "
                "the model as a generative model.")
    return "Embedding API is not supported by this model. Try converting the model using `--convert embed`."

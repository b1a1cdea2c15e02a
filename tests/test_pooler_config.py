"""--runner, --convert and --pooler-config: vLLM 0.32's names and choices, the values pagedllm does not run refused
with a message naming them, and the sentence-transformers folder read as vLLM reads it."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedllm.config import EngineConfig
from pagedllm.config.pooler import resolve_pooler, runner_type, sentence_transformers_pooling
from pagedllm.entrypoints.cli.serve import add_parser, configs_from_args


def _engine(*flags: str) -> EngineConfig:
    parser = argparse.ArgumentParser(prog="pagedllm")
    return configs_from_args(add_parser(parser.add_subparsers()).parse_args(["some/model", *flags]))[0]


def test_flags_parse():
    mc = _engine("--runner", "pooling", "--convert", "embed", "--pooler-config",
                 '{"pooling_type": "MEAN", "use_activation": false, "dimensions": 8}').model_config
    assert (mc.runner, mc.convert) == ("pooling", "embed")
    assert (mc.pooler.seq_pooling_type, mc.pooler.use_activation, mc.pooler.dimensions) == ("MEAN", False, 8)
    assert _engine().model_config.pooler is None and _engine().model_config.runner == "auto"
    with pytest.raises(SystemExit):  # not one of vLLM's choices: argparse's error
        _engine("--runner", "encode")


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"runner": "draft"}, "--runner draft is not supported"),
    ({"convert": "classify"}, "--convert classify is not supported"),
    ({"runner": "pooling", "convert": "none"}, "does not support `--runner pooling`"),
    ({"runner": "generate", "convert": "embed"}, "--runner generate"),
    ({"pooler_config": '{"normalize": true}'}, "`normalize` was removed; use `use_activation`"),
    ({"pooler_config": '{"pooling_type": "ALL"}'}, "pooling_type 'ALL'"),
    ({"pooler_config": '{"pooling_type": "MAX"}'}, "'MAX' is not one of"),
    ({"pooler_config": '{"task": "classify"}'}, "task is not supported"),
    ({"pooler_config": '{"max_embed_len": 10}'}, "max_embed_len is not supported"),
    ({"pooler_config": '{"colour": 1}'}, "unknown --pooler-config keys: colour"),
    ({"pooler_config": "{"}, "not valid JSON"),
])
def test_refused_values_name_themselves(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig.from_kwargs(model="m", **kwargs)


def test_sentence_transformers_folder(tmp_path):
    assert runner_type("auto", "auto", str(tmp_path)) == "generate"
    assert runner_type("auto", "embed", str(tmp_path)) == "pooling"
    assert sentence_transformers_pooling(str(tmp_path)) == {}
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (tmp_path / "1_Pooling").mkdir()
    for config, expected in [({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "CLS"),
                             ({"pooling_mode_lasttoken": True}, "LAST"), ({"pooling_mode": "mean"}, "MEAN")]:
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(config))
        assert sentence_transformers_pooling(str(tmp_path)) == {"seq_pooling_type": expected, "use_activation": True}
    assert runner_type("auto", "auto", str(tmp_path)) == "pooling"
    # --pooler-config wins over the folder; config.json's matryoshka keys allow dimensions
    pooler = EngineConfig.from_kwargs(model="m", pooler_config={"pooling_type": "LAST"}).model_config.pooler
    defaults = resolve_pooler(pooler, str(tmp_path), {"is_matryoshka": True}, 64)
    assert (defaults.pooling_type, defaults.use_activation, defaults.is_matryoshka) == ("LAST", True, True)
    assert resolve_pooler(None, str(tmp_path), {}, 64).pooling_type == "MEAN"

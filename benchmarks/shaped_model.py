"""A random-weight model folder in a real model's shape, for benchmarks of families no machine here can download.

    python benchmarks/shaped_model.py qwen3-0.6b /tmp/qwen3-0.6b-shaped [--dtype bfloat16]

Built with transformers' own config and model classes (normal(0, 0.02) weights, unit norms) and saved as
safetensors, with a word-level tokenizer whose vocabulary is the model's whole vocabulary (token i is "t<i>", so
random token-id prompts decode and re-encode to themselves, and every sampled id has a text) and a ChatML chat
template. Speed depends on the shapes only: the weights' values do not matter to a benchmark.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SHAPES = {
    # Qwen/Qwen3-0.6B's config.json (tied embeddings, head_dim 128 with hidden 1024 and 16 heads)
    "qwen3-0.6b": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960,
        rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=151643,
        eos_token_id=151645)),
    # HuggingFaceTB/SmolLM2-135M-Instruct's config.json (the default model's shape; LoRA benchmarks need a folder)
    "smollm2-135m": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        vocab_size=49152, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)),
}
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def word_level_tokenizer(vocab_size: int, eos_id: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = {eos_id - 2: "<|endoftext|>", eos_id - 1: "<|im_start|>", eos_id: "<|im_end|>"}
    vocab = {specials.get(i, f"t{i}"): i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        bos_token=None, unk_token="t0")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = CHATML
    return tokenizer


def build(shape: str, out: Path, dtype: str) -> None:
    import torch
    import transformers

    config_name, model_name, fields = SHAPES[shape]
    config = getattr(transformers, config_name)(**fields)
    config.architectures = [model_name]
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = getattr(transformers, model_name)(config).to(getattr(torch, dtype))
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    word_level_tokenizer(config.vocab_size, config.eos_token_id).save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": config.eos_token_id}))
    params = sum(p.numel() for p in model.parameters())
    print(f"{shape}: {params / 1e6:.0f}M parameters ({dtype}) in {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("out", type=Path)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    args = parser.parse_args()
    build(args.shape, args.out, args.dtype)


if __name__ == "__main__":
    main()

"""PEFT LoRA adapters with random non-zero weights for the tiny test Llama (PEFT's own init sets B = 0, which would
make an adapter a no-op), and transformers' greedy decoding with PEFT's merged model as the reference."""

from __future__ import annotations

from pathlib import Path

import torch

NUM_TOKENS = 8
"""Greedy tokens every LoRA test generates and compares."""


def make_adapter(model_dir: Path, out: Path, seed: int, r: int = 8, alpha: float = 16,
                 targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"), use_rslora: bool = False, **config) -> Path:
    """Save a PEFT LoRA adapter of `model_dir` with A and B drawn at random (seeded) to `out`."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=r, lora_alpha=alpha, target_modules=list(targets),
                                                  lora_dropout=0.0, use_rslora=use_rslora, **config))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.15)
    peft_model.save_pretrained(out)
    return out


def merged_model(model_dir: Path, adapter_dir: Path | None):
    """transformers' model in fp32 with the adapter merged into its weights (PEFT's merge_and_unload), or the base
    model when adapter_dir is None."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir).merge_and_unload()
    return model.eval()


def hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(num_tokens):
            next_id = int(model(ids).logits[0, -1].argmax())
            out.append(next_id)
            ids = torch.cat([ids, torch.tensor([[next_id]])], dim=1)
    return out

"""The real SmolLM2-135M-Instruct GGUF (Q4_1/Q8_0) against transformers loading the same file."""

from __future__ import annotations

import pytest
import torch
from paged_runner import PagedRunner

from pagedllm.config import ModelConfig
from pagedllm.models.loader import load_model, resolve_model

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2():
    return load_model(ModelConfig(), torch.device("cpu"), torch.float32)


def transformers_reference(path):
    """transformers' own GGUF tensor path (dequantized, Q/K un-permuted) in its LlamaForCausalLM.

    The config is written out from the model card's numbers (transformers' GGUF config parse alone
    takes ~10 s here); the model is built on the meta device and loaded with assign=True.
    """
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    tensors = {name: t.float() for name, t in tensors.items()}
    tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])
    model.load_state_dict(tensors, strict=True, assign=True)
    model.model.rotary_emb = LlamaRotaryEmbedding(config)  # its buffer was built on meta
    model.tie_weights()
    return model.eval()


def test_smollm2_config(smollm2):
    info = smollm2.info
    assert (info.num_layers, info.num_heads, info.num_kv_heads, info.vocab_size) == (30, 9, 3, 49152)
    assert (info.hidden_size, info.head_dim, info.max_position_embeddings) == (576, 64, 8192)
    assert info.tie_word_embeddings and info.eos_token_ids == (2,)


def test_smollm2_logits_match_transformers(smollm2):
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2, 198, 1, 4093, 198, 19556, 905, 28, 638]
    reference = transformers_reference(resolve_model(None).path)
    with torch.no_grad():
        ref = reference(torch.tensor([ids])).logits[0].float()  # [T, vocab]
    runner = PagedRunner(smollm2)
    out = torch.cat([runner.step([("a", ids[:12])]), runner.step([("a", ids[12:])])])
    assert (out - ref).abs().max().item() < 1e-3

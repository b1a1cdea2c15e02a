"""Qwen3-MoE and Mixtral (models/qwen3_moe.py, models/mixtral.py: layers/fused_moe.py) against transformers' own
classes, fp32, greedy.

Each family is a tiny random model built with transformers' config and model classes (8 experts, top-2, hidden 64,
3 layers) and saved as safetensors, per expert as transformers writes it: Qwen3-MoE with its per-head q/k norms, an
explicit head_dim, top-k weights not renormalised (transformers' default) and layer 1 dense (`mlp_only_layers`);
Mixtral with its `block_sparse_moe.experts.{e}.w1/w2/w3` names. pagedllm must give transformers' greedy tokens
through every engine path (window_family_checks.check_engine_paths: n > 1, prefix-cache hits, chunked prefill,
preemption, n-gram speculation, fp8 KV), TP=2, PP=2 and EP=2 (TP=2 with --enable-expert-parallel: 4 experts whole
on each rank); a divergence is allowed only where the reference's top-2 logit gap is below 1e-4. The routed-token
balance is read from /metrics of a real server. Their GGUF files: test_llamacpp_gguf.py.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch
from paged_runner import PagedRunner
from safetensors.torch import load_file, save_file
from window_family_checks import (
    GREEDY,
    assert_matches,
    check_engine_paths,
    check_native_step_declines,
    check_pipeline_parallel,
    check_tensor_parallel,
    llm,
    prompts,
    reference,
    save,
    tokens,
)

from pagedllm.config import ModelConfig, ParallelConfig
from pagedllm.distributed.parallel_state import TensorParallelGroup
from pagedllm.kernels import cpu_kernels
from pagedllm.layers.fused_moe import FusedMoE, route
from pagedllm.models.llama import LlamaMLP
from pagedllm.models.loader import load_model
from pagedllm.models.model_info import ModelLoadError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "entrypoints"))  # server_utils: a real server
CPU = torch.device("cpu")
NUM_EXPERTS, TOP_K, EXPERT_SIZE = 8, 2, 32


def qwen3_moe_config(vocab: int, **overrides):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(**{
        "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": EXPERT_SIZE,
        "num_experts": NUM_EXPERTS, "num_experts_per_tok": TOP_K, "norm_topk_prob": False, "mlp_only_layers": [1],
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "initializer_range": 0.08,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, **overrides})


def mixtral_config(vocab: int, **overrides):
    from transformers import MixtralConfig

    return MixtralConfig(**{
        "vocab_size": vocab, "hidden_size": 64, "intermediate_size": EXPERT_SIZE, "num_local_experts": NUM_EXPERTS,
        "num_experts_per_tok": TOP_K, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "initializer_range": 0.08, "sliding_window": None,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, **overrides})


@pytest.fixture(scope="module")
def qwen3_moe_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    from transformers import Qwen3MoeForCausalLM

    folder = tmp_path_factory.mktemp("tiny-qwen3-moe")
    tiny_tokenizer.save_pretrained(folder)
    torch.manual_seed(11)
    save(folder, Qwen3MoeForCausalLM(qwen3_moe_config(len(tiny_tokenizer))).float())
    return folder


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    from transformers import MixtralForCausalLM

    folder = tmp_path_factory.mktemp("tiny-mixtral")
    tiny_tokenizer.save_pretrained(folder)
    torch.manual_seed(12)
    save(folder, MixtralForCausalLM(mixtral_config(len(tiny_tokenizer))).float())
    return folder


FAMILIES = ["qwen3_moe_dir", "mixtral_dir"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    """(folder, the transformers model loaded from it in fp32)."""
    from transformers import AutoModelForCausalLM

    folder = request.getfixturevalue(request.param)
    return folder, AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def test_routing_rules():
    """Mixtral's weights are the softmax over the top-k logits; Qwen3-MoE's the top-k of the softmax over all, summing
    to 1 only with norm_topk_prob."""
    logits = torch.randn(5, NUM_EXPERTS)
    weights, ids = route(logits, TOP_K, renormalize=True)
    assert torch.equal(ids, logits.topk(TOP_K).indices)
    torch.testing.assert_close(weights, torch.softmax(logits.topk(TOP_K).values, dim=-1))
    plain, _ = route(logits, TOP_K, renormalize=False)
    torch.testing.assert_close(plain, torch.softmax(logits, dim=-1).topk(TOP_K).values)
    assert (plain.sum(-1) < 1).all()


def test_layers_stacked_experts_and_logits(family):
    """Experts stacked at load ([E, 2 * I, hidden] and [E, hidden, I]), Qwen3-MoE's layer 1 dense; transformers'
    logits at a prefill and two decodes."""
    folder, hf = family
    model = load_model(ModelConfig(model=str(folder)), CPU, torch.float32)
    assert type(model).__name__ == hf.config.architectures[0]
    dense = [1] if hf.config.model_type == "qwen3_moe" else []
    assert [type(layer.mlp) for layer in model.model.layers] == [
        LlamaMLP if i in dense else FusedMoE for i in range(3)]
    experts = model.model.layers[0].mlp.experts
    assert (experts.num_experts, experts.gate_up_proj.out_features, experts.down_proj.in_features) == (
        NUM_EXPERTS, 2 * EXPERT_SIZE, EXPERT_SIZE)
    ids = torch.randint(0, hf.config.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    runner = PagedRunner(model)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(runner.step([("a", ids[:-2])]), want[:-2], atol=1e-4, rtol=1e-4)
        for i in (-2, -1):
            torch.testing.assert_close(runner.step([("a", [ids[i]])])[0], want[i], atol=1e-4, rtol=1e-4)


def test_greedy_matches_transformers_on_every_engine_path(family):
    check_engine_paths(*family)


@pytest.mark.skipif(not cpu_kernels.available(torch.float32, CPU), reason="native CPU kernels unavailable")
@pytest.mark.parametrize(("fixture", "reason"), [("qwen3_moe_dir", "per-head q/k norms"),
                                                 ("mixtral_dir", "mixture-of-experts layers")])
def test_native_decode_step_declines(request, fixture, reason, caplog):
    """--quantization fp8 makes every linear, each expert's included, a native-kernel weight: the native decode step
    is not built (its C loop has Llama's dense MLP), with one line at load, and the modules decode."""
    check_native_step_declines(request.getfixturevalue(fixture), caplog, reason)


def test_missing_expert_is_refused_at_load_by_name(mixtral_dir, tmp_path):
    for file in mixtral_dir.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    weights = load_file(tmp_path / "model.safetensors")
    for proj in ("w1", "w2", "w3"):
        del weights[f"model.layers.2.block_sparse_moe.experts.5.{proj}.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model.layers.2.mlp.experts lacks the gate_up_proj weights of "
                                             r"experts \[5\]"):
        load_model(ModelConfig(model=str(tmp_path)), CPU, torch.float32)


@pytest.mark.slow  # two worker processes
def test_tensor_parallel_2_matches_transformers(family):
    """Each expert's intermediate size split across the ranks (as the dense MLP's), the router replicated."""
    check_tensor_parallel(*family)


@pytest.mark.slow  # two worker processes
def test_pipeline_parallel_2_gives_one_stages_tokens(family):
    folder, hf = family
    check_pipeline_parallel(folder, hf.config.vocab_size)


def test_expert_parallel_needs_tensor_parallel():
    with pytest.raises(ValueError, match="--enable-expert-parallel .* needs --tensor-parallel-size > 1"):
        ParallelConfig(enable_expert_parallel=True)
    assert ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True).enable_expert_parallel


def test_expert_parallel_rank_holds_its_experts_whole(family):
    """Rank 1 of 2 under expert parallelism loads experts 4-7 of each sparse layer, whole (their full intermediate
    size), as transformers holds them; the router stays whole on every rank."""
    folder, hf = family
    tp = TensorParallelGroup(1, 2, expert_parallel=True)  # no collective runs at load
    model = load_model(ModelConfig(model=str(folder)), CPU, torch.float32, tp)
    moe = model.model.layers[0].mlp
    assert (moe.experts.first_expert, moe.experts.num_experts) == (4, 4)
    assert moe.gate.out_features == NUM_EXPERTS
    want = hf.model.layers[0].mlp.experts
    for local, expert in enumerate(range(4, 8)):
        x = torch.randn(3, 64)
        with torch.no_grad():
            got = moe.experts(local, x)
            gate, up = torch.nn.functional.linear(x, want.gate_up_proj[expert]).chunk(2, dim=-1)
            ref = torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, want.down_proj[expert])
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.slow  # two worker processes
def test_expert_parallel_2_matches_the_single_process_run(family):
    """EP=2 (TP=2 with --enable-expert-parallel): the single-process engine's greedy tokens and transformers', up to
    a reference near-tie, on every prompt, the second pass hitting the prefix cache."""
    folder, hf = family
    ps = prompts(hf.config.vocab_size)
    want = [reference(hf, p) for p in ps]
    single = tokens(llm(folder).generate(ps, GREEDY, use_tqdm=False))
    engine = llm(folder, tensor_parallel_size=2, enable_expert_parallel=True)
    try:
        for _ in range(2):
            for got, one, ref in zip(tokens(engine.generate(ps, GREEDY, use_tqdm=False)), single, want, strict=True):
                assert_matches(one, ref)
                assert_matches(got, ref)
                assert got == one or min(ref[1]) < 1e-4
    finally:
        engine.llm_engine.engine_core.shutdown()


def _routed_tokens(server) -> dict[str, float]:
    """pagedllm:moe_routed_tokens_total from /metrics: expert label -> value."""
    counts = {}
    for line in server.get("/metrics").text.splitlines():
        if line.startswith("pagedllm:moe_routed_tokens_total{"):
            expert = line.split('expert="', 1)[1].split('"', 1)[0]
            counts[expert] = float(line.rsplit(" ", 1)[1])
    return counts


@pytest.mark.slow  # a real server
def test_routed_token_balance_in_metrics(mixtral_dir):
    """/metrics of `pagedllm serve` counts the tokens routed to each expert, summed over the layers: one series per
    expert, together top_k x layers x the tokens the model ran (the prompt, and each generated token but the last)."""
    from server_utils import RemoteServer

    server = RemoteServer(mixtral_dir, "--no-enable-prefix-caching")
    try:
        assert _routed_tokens(server) == {}  # nothing reported before a step ran
        out = server.client().completions.create(model="tiny", prompt="The quick brown fox jumps over the lazy dog.",
                                                 max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})
        expected = (out.usage.prompt_tokens + out.usage.completion_tokens - 1) * TOP_K * 3
        deadline = time.monotonic() + 10
        while sum(_routed_tokens(server).values()) < expected and time.monotonic() < deadline:
            time.sleep(0.05)
        counts = _routed_tokens(server)
    finally:
        server.close()
    assert set(counts) == {str(e) for e in range(NUM_EXPERTS)}
    assert sum(counts.values()) == expected
    assert sum(1 for c in counts.values() if c > 0) >= TOP_K

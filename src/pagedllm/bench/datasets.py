"""Benchmark prompts: vLLM's `random` and `prefix-repetition` synthetic datasets and a local JSONL one.

Each generator returns `SampleRequest`s whose `prompt_len` is the prompt's length under the client's
tokenizer. Synthetic prompts are built from token ids and then decoded; because decode-then-encode does not
always round-trip (GPT-2: [6880, 6881] -> " calls" + "here" -> [1650, 939, 486]), the ids are re-encoded and
truncated or padded until the text encodes to the requested length, as vLLM does. Given the same tokenizer
and seed, the random dataset draws the same numbers in the same order as vLLM's, so both clients send the
same prompts.
"""

from __future__ import annotations

import json
import logging
import math
import random
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)


@dataclass
class SampleRequest:
    """One benchmark request: the prompt, its token count and how many tokens to ask for."""

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int
    request_id: str | None = None


def decode_to_target_len(
    tokenizer,
    token_ids: list[int],
    target_len: int,
    max_retry: int = 10,
    rng: np.random.Generator | None = None,
    np_random: np.random.RandomState | None = None,
) -> tuple[str, list[int], int]:
    """Decode `token_ids` to text whose re-encoding has `target_len` tokens.

    Each round decodes, re-encodes (no special tokens), then truncates a long sequence or pads a short one
    with random ids in [0, vocab_size), drawn from `rng` (or `np_random`). After `max_retry` rounds the
    remaining difference is returned instead of corrected.

    Returns:
        (prompt, token_ids of the prompt, mismatch = len(token_ids) - target_len; 0 when it converged).
    """
    vocab_size = tokenizer.vocab_size
    num_retries_left = max_retry
    mismatch = 0
    while True:
        prompt = tokenizer.decode(token_ids)
        token_ids = tokenizer.encode(prompt, add_special_tokens=False)
        if num_retries_left <= 0:
            mismatch = len(token_ids) - target_len
            break
        if len(token_ids) == target_len:
            break
        if len(token_ids) < target_len:
            num_missing = target_len - len(token_ids)
            if rng is not None:
                token_ids.extend(rng.integers(0, vocab_size, size=num_missing).tolist())
            else:
                token_ids.extend((np_random or np.random).randint(0, vocab_size, size=num_missing).tolist())
        else:
            token_ids = token_ids[:target_len]
        num_retries_left -= 1
    return prompt, token_ids, mismatch


def sample_random(
    tokenizer,
    num_requests: int,
    input_len: int = 1024,
    output_len: int = 128,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    seed: int = 0,
    request_id_prefix: str = "",
) -> list[SampleRequest]:
    """vLLM's `random` dataset: a shared random prefix, then a run of consecutive allowed token ids.

    Input and output lengths are drawn uniformly from [len * (1 - range_ratio), len * (1 + range_ratio)];
    the input range excludes the special tokens the tokenizer would add.

    Raises:
        ValueError: when range_ratio is outside [0, 1) or no prompt could have a token.
    """
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1), got {range_ratio}.")
    rng = np.random.default_rng(seed)
    num_special = int(tokenizer.num_special_tokens_to_add())
    real_input_len = max(0, int(input_len) - num_special)
    input_low = math.floor(real_input_len * (1 - range_ratio))
    input_high = math.ceil(real_input_len * (1 + range_ratio))
    output_low = max(math.floor(output_len * (1 - range_ratio)), 1)
    output_high = max(math.ceil(output_len * (1 + range_ratio)), 1)
    if prefix_len + input_low < 1:
        raise ValueError(
            f"--random-input-len {input_len} is too small: after {num_special} special tokens and range ratio "
            f"{range_ratio}, a prompt could have no token. Raise --random-input-len or --random-prefix-len."
        )
    logger.info("Sampling input_len from [%d, %d] and output_len from [%d, %d]",
                input_low, input_high, output_low, output_high)
    input_lens = rng.integers(input_low, input_high + 1, size=num_requests)
    output_lens = rng.integers(output_low, output_high + 1, size=num_requests)
    offsets = rng.integers(0, tokenizer.vocab_size, size=num_requests)

    special_ids = set(tokenizer.all_special_ids)
    allowed_ids = np.array([t for t in range(tokenizer.vocab_size) if t not in special_ids])
    prefix_ids: list[int] = []
    if prefix_len > 0:
        prefix_ids = allowed_ids[rng.integers(0, len(allowed_ids), size=prefix_len)].tolist()
        _, prefix_ids, mismatch = decode_to_target_len(tokenizer, prefix_ids, prefix_len, rng=rng)
        _warn_mismatch(mismatch)

    requests = []
    total_mismatch = 0
    for i in range(num_requests):
        # Consecutive allowed ids from a per-request offset: prompt i and i+1 differ in every position.
        inner_ids = allowed_ids[(int(offsets[i]) + i + np.arange(int(input_lens[i]))) % len(allowed_ids)].tolist()
        prompt, token_ids, mismatch = decode_to_target_len(
            tokenizer, prefix_ids + inner_ids, prefix_len + int(input_lens[i]), rng=rng)
        total_mismatch += mismatch
        requests.append(SampleRequest(prompt, len(token_ids), int(output_lens[i]), request_id_prefix + str(i)))
    _warn_mismatch(total_mismatch)
    return requests


def sample_prefix_repetition(
    tokenizer,
    num_requests: int,
    prefix_len: int = 256,
    suffix_len: int = 256,
    num_prefixes: int = 10,
    output_len: int = 128,
    seed: int = 0,
    shuffle: bool = True,
    request_id_prefix: str = "",
) -> list[SampleRequest]:
    """vLLM's `prefix-repetition` dataset: `num_prefixes` random prefixes, each shared by
    `num_requests // num_prefixes` prompts that end in their own random suffix; then shuffled.

    Raises:
        ValueError: when there are fewer requests than prefixes.
    """
    prompts_per_prefix = num_requests // num_prefixes
    if prompts_per_prefix == 0:
        raise ValueError(f"--num-prompts ({num_requests}) must be at least "
                         f"--prefix-repetition-num-prefixes ({num_prefixes}).")
    np_random = np.random.RandomState(seed)
    total_mismatch = 0

    def exact_length_ids(length: int) -> list[int]:
        nonlocal total_mismatch
        ids = np_random.randint(0, tokenizer.vocab_size, size=length).tolist()
        _, ids, mismatch = decode_to_target_len(tokenizer, ids, length, np_random=np_random)
        total_mismatch += mismatch
        return ids

    requests = []
    for _ in range(num_prefixes):
        prefix_ids = exact_length_ids(prefix_len)
        for _ in range(prompts_per_prefix):
            token_ids = prefix_ids + exact_length_ids(suffix_len)
            requests.append(SampleRequest(tokenizer.decode(token_ids), len(token_ids), output_len))
    _warn_mismatch(total_mismatch)
    if shuffle:
        random.Random(seed).shuffle(requests)
    for i, request in enumerate(requests):
        request.request_id = request_id_prefix + str(i)
    return requests


def sample_custom(
    tokenizer,
    path: str,
    num_requests: int,
    output_len: int = 256,
    skip_chat_template: bool = False,
    seed: int = 0,
    shuffle: bool = True,
    request_id_prefix: str = "",
) -> list[SampleRequest]:
    """Prompts from a local JSONL file, one object per line with a "prompt" field and optionally
    "output_tokens".

    As in vLLM's `custom` dataset: every request asks for `output_len` tokens, unless it is -1, which
    takes each line's "output_tokens"; the prompt is wrapped in the tokenizer's chat template (when it has
    one) unless `skip_chat_template`; lines are shuffled with `seed`, and reused at random when the file
    has fewer than `num_requests`.

    Raises:
        ValueError: when a line is not a JSON object with a string "prompt", or `output_len` is -1 and
            a line has no integer "output_tokens", or the file is empty.
    """
    rows = _read_jsonl(path)
    if shuffle:
        random.Random(seed).shuffle(rows)
    use_template = not skip_chat_template and getattr(tokenizer, "chat_template", None)
    requests = []
    for row in rows[:num_requests]:
        prompt = row["prompt"]
        if use_template:
            prompt = tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)
        prompt_len = len(tokenizer(prompt).input_ids)
        requests.append(SampleRequest(prompt, prompt_len, _custom_output_len(row, output_len)))
    if len(requests) < num_requests:
        logger.info("Oversampling %d requests to reach %d", num_requests - len(requests), num_requests)
        reuse = random.Random(seed).choices(requests, k=num_requests - len(requests))
        requests += [SampleRequest(r.prompt, r.prompt_len, r.expected_output_len) for r in reuse]
    for i, request in enumerate(requests):
        request.request_id = request_id_prefix + str(i)
    return requests


def _custom_output_len(row: dict, output_len: int) -> int:
    if output_len != -1:
        return output_len
    value = row.get("output_tokens")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"With --custom-output-len -1 every line needs a positive integer "
                         f"\"output_tokens\"; got {value!r} for prompt {row['prompt'][:40]!r}.")
    return value


def _read_jsonl(path: str) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str):
                raise ValueError(f"{path}:{line_no}: each line must be a JSON object with a string \"prompt\".")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no prompts.")
    return rows


def _warn_mismatch(total_mismatch: int) -> None:
    if total_mismatch:
        logger.warning("Across all prompts there were %d %s tokens than requested after decoding and "
                       "re-encoding; the sampling cannot always hit the length exactly.",
                       abs(total_mismatch), "more" if total_mismatch > 0 else "fewer")

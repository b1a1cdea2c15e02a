"""Incremental detokenization and stop strings, one instance per request (vLLM's algorithm).

Each new token is decoded together with a few tokens before it: `prefix_offset..read_offset` is text
already emitted, `read_offset..` is new. The new text is the difference between the two decodes, and is
held back while it ends in U+FFFD (a multi-byte UTF-8 character split across tokens is not complete yet).

Example: "é" is two bytes that a byte-level BPE may split over tokens t1, t2. After t1 the decode of
[..., t1] ends in U+FFFD, so nothing is emitted and the offsets stay; after t2 the decode of [..., t1, t2]
ends in "é", which is emitted, and both offsets move forward.

Decoding follows the tokenizer's own `convert_tokens_to_string`, so the text equals
`tokenizer.decode(ids, skip_special_tokens=...)`. `spaces_between_special_tokens` is passed to the
tokenizer's decode; Hugging Face fast tokenizers ignore it (as in vLLM with a fast tokenizer).

An id the tokenizer lacks (a model whose vocab_size is padded past its tokenizer, as Qwen2.5's 151,936 rows over
151,665 tokens, can sample one) is the empty token "": it adds no text and never fails, as in vLLM.
"""

from __future__ import annotations

from typing import Any

from pagedllm.sampling_params import SamplingParams

# Prompt tokens decoded before the first output token, so that it is decoded in context
# (e.g. a SentencePiece leading space).
_INITIAL_OFFSET = 5
_REPLACEMENT_CHAR = "\ufffd"


def decode_token(tokenizer: Any, token_id: int) -> str:
    """The text of one token alone (for logprobs); a partial UTF-8 byte decodes to U+FFFD, and an id the
    tokenizer lacks (a vocab_size padded past the tokenizer, as Qwen2.5's is) to "" (vLLM's
    convert_ids_list_to_tokens: `tokenizer.decode([id]) or ""`)."""
    try:
        return tokenizer.decode([token_id]) or ""
    except (IndexError, KeyError, TypeError, ValueError, OverflowError):  # a slow tokenizer's lookup of the id
        return ""


class IncrementalDetokenizer:
    """Turns a request's output tokens into text as they arrive and checks its stop strings.

    Args:
        tokenizer: a Hugging Face tokenizer (`convert_ids_to_tokens` + `convert_tokens_to_string`).
        prompt_token_ids: the prompt; its last few tokens give the first output token its context.
        params: the request's SamplingParams (stop, include_stop_str_in_output, min_tokens,
            skip_special_tokens, detokenize).
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.skip_special_tokens = params.skip_special_tokens
        self.detokenize = params.detokenize
        self.stop = list(params.stop)
        self.include_stop_str_in_output = params.include_stop_str_in_output
        self.min_tokens = params.min_tokens
        # Characters a stream holds back so that it never shows the start of a stop string it will cut.
        if self.stop and not self.include_stop_str_in_output:
            self.stop_buffer_length = max(len(s) for s in self.stop) - 1
        else:
            self.stop_buffer_length = 0
        self.max_stop_len = max((len(s) for s in self.stop), default=0)

        self._backend = _stock_fast_backend(tokenizer) if self.detokenize else None
        self._decoder = self._backend.decoder if self._backend is not None else None
        self._skip_ids = (frozenset(tokenizer.all_special_ids) if self._backend is not None and self.skip_special_tokens
                          else frozenset())
        self._num_tokens: int | None = None
        self.output_token_ids: list[int] = []
        self.output_text = ""
        self._last_output_text_offset = 0
        self.stopped = False
        self.num_dropped = 0
        """Tokens of the last update() after the one that completed a stop string (dropped: not output)."""
        prompt_tail = prompt_token_ids[-_INITIAL_OFFSET - 2:]
        self._tokens: list[str] = self._to_tokens(prompt_tail)
        self._read_offset = len(self._tokens)
        self._prefix_offset = max(self._read_offset - _INITIAL_OFFSET, 0)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Decode new tokens and check stop strings.

        Returns: the stop string that matched, else None. On a match `output_text` is truncated just
        before the stop string (or just after it with include_stop_str_in_output), the new tokens after the one
        that completed it are not kept (`num_dropped` says how many), and the caller finishes the request. Stop
        strings do not fire while the output has at most min_tokens tokens.
        """
        self.num_dropped = 0
        if self.stopped:
            return None
        stop_check_offset = len(self.output_text)
        match = None
        for i, token_id in enumerate(new_token_ids):
            self.output_token_ids.append(token_id)
            if self.detokenize:
                self.output_text += self._decode_next(token_id)
            if self.min_tokens and len(self.output_token_ids) <= self.min_tokens:
                stop_check_offset = len(self.output_text)
            elif self.stop and i < len(new_token_ids) - 1:
                # Several tokens at once (speculative decoding): a stop string that one of them completes ends
                # the output there, as if they had come one by one; the tokens after it are dropped.
                match = self._find_stop(len(self.output_text) - stop_check_offset)
                if match is not None:
                    self.num_dropped = len(new_token_ids) - i - 1
                    break
        if not self.stop:
            return None
        if match is None:
            match = self._find_stop(len(self.output_text) - stop_check_offset)
        if match is None:
            return None
        stop_str, truncate_to = match
        self.output_text = self.output_text[:truncate_to]
        self.stopped = True
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to send now: all of it (delta=False) or what is new since the last call (delta=True).

        Until finished, the last `stop_buffer_length` characters are held back: they may be the start
        of a stop string that will be cut. Once finished, bytes of a character that never completed are
        flushed as U+FFFD, so the final text equals `tokenizer.decode(output_token_ids)`.
        """
        if finished and not self.stopped:
            self._flush()
        buffer_length = 0 if finished else self.stop_buffer_length
        length = len(self.output_text) - buffer_length
        if not delta:
            return self.output_text[:max(length, 0)]
        last = self._last_output_text_offset
        if last >= length:
            return ""
        self._last_output_text_offset = length
        return self.output_text[last:length]

    def _decode_next(self, token_id: int) -> str:
        """Append one token and return the text it completes ("" while a character is incomplete)."""
        self._tokens.extend(self._to_tokens([token_id]))
        window = self._tokens[self._prefix_offset:]
        prefix_text = self._to_string(self._tokens[self._prefix_offset:self._read_offset])
        new_text = self._to_string(window)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return new_text[len(prefix_text):]

    def _flush(self) -> None:
        """Emit what the held tokens decode to even though it ends in U+FFFD (the output is over)."""
        if self._read_offset == len(self._tokens):
            return
        prefix_text = self._to_string(self._tokens[self._prefix_offset:self._read_offset])
        new_text = self._to_string(self._tokens[self._prefix_offset:])
        self.output_text += new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset = len(self._tokens)

    def _find_stop(self, num_new_chars: int) -> tuple[str, int] | None:
        """The earliest stop string that overlaps the new characters, and where to cut the text.

        Only the new characters plus (len(stop) - 1) before them are searched, so the cost per step
        does not grow with the output.
        """
        if num_new_chars <= 0:
            return None
        text = self.output_text
        best: tuple[int, str] | None = None
        for stop_str in self.stop:
            start = max(len(text) - num_new_chars - len(stop_str) + 1, 0)
            index = text.find(stop_str, start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop_str)
        if best is None:
            return None
        index, stop_str = best
        return stop_str, index + len(stop_str) if self.include_stop_str_in_output else index

    def _to_tokens(self, token_ids: list[int]) -> list[str]:
        if not self.detokenize or not token_ids:
            return []
        if self._backend is not None:  # what convert_ids_to_tokens does, without its per-call special-token list
            id_to_token, skip_ids = self._backend.id_to_token, self._skip_ids
            # an id past the tokenizer has no token (None): it is "" (vLLM's _replace_none_with_empty)
            return [id_to_token(token_id) or "" for token_id in token_ids if token_id not in skip_ids]
        convert, skip = self.tokenizer.convert_ids_to_tokens, self.skip_special_tokens
        try:
            tokens = convert(token_ids, skip_special_tokens=skip)
            if None not in tokens:
                return tokens
        except (IndexError, KeyError, TypeError, ValueError, OverflowError):  # a slow tokenizer's lookup of an id
            pass
        # an id past the tokenizer is "" in place, never looked up (vLLM's detokenize_incrementally)
        if self._num_tokens is None:
            self._num_tokens = len(self.tokenizer)  # only now: a slow tokenizer's len() may walk its vocabulary
        num_tokens = self._num_tokens
        return [token or "" for token_id in token_ids
                for token in (convert([token_id], skip_special_tokens=skip) if 0 <= token_id < num_tokens else [""])]

    def _to_string(self, tokens: list[str]) -> str:
        if not tokens:
            return ""
        if self._backend is not None:  # what convert_tokens_to_string does
            return self._decoder.decode(tokens) if self._decoder is not None else " ".join(tokens)
        return self.tokenizer.convert_tokens_to_string(tokens)


def _stock_fast_backend(tokenizer: Any) -> Any:
    """The `tokenizers.Tokenizer` behind a transformers fast tokenizer whose convert_ids_to_tokens and
    convert_tokens_to_string are the stock ones, so that calling the backend gives the same tokens and text;
    None for any other tokenizer (those go through their own methods).

    The stock convert_ids_to_tokens rebuilds the list of special tokens on every call: per output token that
    was half of the detokenizer's CPU time (benchmarks/serving_cpu.py)."""
    try:
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    cls = type(tokenizer)
    if (not isinstance(tokenizer, PreTrainedTokenizerFast)
            or cls.convert_ids_to_tokens is not PreTrainedTokenizerFast.convert_ids_to_tokens
            or cls.convert_tokens_to_string is not PreTrainedTokenizerFast.convert_tokens_to_string):
        return None
    return tokenizer.backend_tokenizer

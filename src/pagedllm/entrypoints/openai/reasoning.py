"""Reasoning split out of the output (`--reasoning-parser`, vLLM's): a finished output's text into (reasoning,
content), or a stream's text, piece by piece, into reasoning and content deltas; and the structured output of a
request that starts inside its reasoning constrained only after it (the engine is told the tokens that end it:
`StructuredOutputsParams.reasoning_end_token_ids`). Tool calls are read from the content only.

The parsers (the tags, and whether a request thinks) are the modules of reasoning_parsers/."""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import Any

import msgspec

from pagedllm.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from pagedllm.entrypoints.openai.tool_parsers.partial_calls import partial_marker_len
from pagedllm.sampling_params import SamplingParams


class ReasoningParser:
    """The server's --reasoning-parser over its tokenizer; raises ValueError at start-up when the tags are not
    tokens of the vocabulary (as vLLM refuses)."""

    def __init__(self, name: str, tokenizer):
        self.name = name
        self.parser: ModuleType = get_reasoning_parser(name)
        vocab = tokenizer.get_vocab()
        ids = {tag: vocab.get(tag) for tag in (self.parser.START, self.parser.END)}
        missing = [tag for tag, token_id in ids.items() if token_id is None]
        if missing:
            raise ValueError(f"--reasoning-parser {name}: the tokenizer has no token {missing[0]!r}, so this model's "
                             "output has no reasoning this parser can find.")
        self.start_id: int = ids[self.parser.START]
        self.end_id: int = ids[self.parser.END]
        self.implicit_end_ids = [vocab[t] for t in self.parser.IMPLICIT_ENDS if t in vocab]
        self.boundary_ids = {vocab[t] for t in self.parser.TURN_BOUNDARIES if t in vocab}

    def for_request(self, chat_template_kwargs: dict[str, Any] | None) -> RequestReasoning:
        return RequestReasoning(self, self.parser.thinking(chat_template_kwargs))


class RequestReasoning:
    """One request's reasoning: whether its output begins inside the reasoning (`thinking`), and the splits."""

    def __init__(self, server: ReasoningParser, thinking: bool):
        self.server = server
        self.parser = server.parser
        self.thinking = thinking

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished output; None for an empty part."""
        splitter = ReasoningStream(self)
        reasoning, content = splitter.feed(text, finished=True)
        return reasoning or None, content or None

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self)

    def count_tokens(self, token_ids: Sequence[int]) -> int:
        """Output tokens inside the reasoning (before its end; the tags themselves not counted)."""
        if not self.thinking:
            return 0
        ends = {self.server.end_id, *self.server.implicit_end_ids}
        count = 0
        for token_id in token_ids:
            if token_id in ends:
                break
            count += token_id != self.server.start_id
        return count

    def ended_in_prompt(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the prompt has already closed the reasoning (a template that turns thinking off writes
        `<think></think>` itself), as vLLM's is_reasoning_end reads the prompt: the last tag of the current turn."""
        if not self.thinking:
            return True
        for token_id in reversed(prompt_token_ids):
            if token_id == self.server.end_id:
                return True
            if token_id == self.server.start_id or token_id in self.server.boundary_ids:
                return False
        return False

    def constrain_after_reasoning(self, params: SamplingParams, prompt_token_ids: Sequence[int]) -> SamplingParams:
        """`params` whose grammar (if any) starts once the reasoning has ended: the engine leaves the reasoning
        unconstrained and applies the grammar from the token after `</think>` (or an implicit end) on."""
        constraint = params.structured_outputs
        if constraint is None or self.ended_in_prompt(prompt_token_ids):
            return params
        end_ids = [self.server.end_id, *self.server.implicit_end_ids]
        return msgspec.structs.replace(params, structured_outputs=msgspec.structs.replace(
            constraint, reasoning_end_token_ids=end_ids))


class ReasoningStream:
    """A growing output split into reasoning and content: `feed(text)` returns the new (reasoning, content) text
    that may be sent; a tail that may still become a tag is held back until the next piece (or the end)."""

    def __init__(self, reasoning: RequestReasoning):
        self.parser = reasoning.parser
        self.in_reasoning = reasoning.thinking
        self.held = ""

    def feed(self, text: str, finished: bool = False) -> tuple[str, str]:
        buffer, self.held = self.held + text, ""
        reasoning, content = [], []
        while buffer:
            tags = self._tags()
            found = [(i, tag) for tag in tags if (i := buffer.find(tag)) >= 0]
            if not found:
                keep = 0 if finished or not tags else partial_marker_len(buffer, *tags)
                (reasoning if self.in_reasoning else content).append(buffer[:len(buffer) - keep])
                self.held = buffer[len(buffer) - keep:]
                break
            i, tag = min(found)
            (reasoning if self.in_reasoning else content).append(buffer[:i])
            if self.in_reasoning and tag in self.parser.IMPLICIT_ENDS:
                self.in_reasoning = False
                buffer = buffer[i:]  # the tag stays: it begins the content (a tool call)
            else:
                self.in_reasoning = self.in_reasoning and tag != self.parser.END
                buffer = buffer[i + len(tag):]
        return "".join(reasoning), "".join(content)

    def _tags(self) -> tuple[str, ...]:
        if self.in_reasoning:
            return (self.parser.START, self.parser.END, *self.parser.IMPLICIT_ENDS)
        return (self.parser.END,) if self.parser.DROP_END_IN_CONTENT else ()

"""The reasoning parsers (--reasoning-parser qwen3 / deepseek_r1, entrypoints/openai/reasoning.py): whole outputs
and streams split into reasoning and content as vLLM 0.32 splits them, whatever the pieces the stream arrives in;
where the prompt has already ended the reasoning; and the engine side (structured_output/request.py): a grammar
that only starts after the reasoning's end token."""

from __future__ import annotations

from concurrent.futures import Future

import pytest

from pagedllm.config import ServerConfig
from pagedllm.entrypoints.openai.reasoning import ReasoningParser
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.structured_output.request import StructuredOutputRequest

START, END, TOOL, IM_START = 1000, 1001, 1002, 1003


class Vocab:
    def get_vocab(self):
        return {"<think>": START, "</think>": END, "<tool_call>": TOOL, "<|im_start|>": IM_START}


def parser(name: str, **kwargs):
    return ReasoningParser(name, Vocab()).for_request(kwargs or None)


CASES = [
    # (parser, chat_template_kwargs, output, reasoning, content)
    ("qwen3", {}, "<think>plan</think>answer", "plan", "answer"),
    ("qwen3", {}, "plan</think>answer", "plan", "answer"),  # the template opened <think>
    ("qwen3", {}, "still thinking", "still thinking", None),
    ("qwen3", {}, "plan</think>a</think>b", "plan", "ab"),  # a later </think> is dropped
    ("qwen3", {}, "plan<tool_call>{}</tool_call>", "plan", "<tool_call>{}</tool_call>"),  # an implicit end
    ("qwen3", {"enable_thinking": False}, "<think>x</think>answer", None, "<think>xanswer"),
    ("qwen3", {"enable_thinking": False}, "answer", None, "answer"),
    ("deepseek_r1", {}, "<think>plan</think>answer", "plan", "answer"),
    ("deepseek_r1", {}, "plan</think>answer", "plan", "answer"),
    ("deepseek_r1", {}, "plan", "plan", None),
    ("deepseek_r1", {}, "plan</think>", "plan", None),
    ("deepseek_r1", {}, "plan</think>a</think>b", "plan", "a</think>b"),
    ("deepseek_r1", {"enable_thinking": False}, "plan</think>answer", "plan", "answer"),
]


@pytest.mark.parametrize(("name", "kwargs", "output", "reasoning", "content"), CASES)
def test_whole_and_streamed_splits_agree(name, kwargs, output, reasoning, content):
    request = parser(name, **kwargs)
    assert request.split(output) == (reasoning, content)
    for size in (1, 2, 3, 7):  # the stream, in pieces of every size: the same split, nothing lost or doubled
        stream = request.stream()
        pieces = [output[i:i + size] for i in range(0, len(output), size)]
        parts = [stream.feed(piece, finished=i == len(pieces) - 1) for i, piece in enumerate(pieces)]
        assert ("".join(r for r, _ in parts) or None, "".join(c for _, c in parts) or None) == (reasoning, content)


def test_stream_holds_back_a_tail_that_may_become_a_tag():
    stream = parser("qwen3").stream()
    assert stream.feed("plan</th") == ("plan", "")
    assert stream.feed("ink>ans") == ("", "ans")
    assert stream.feed("wer", finished=True) == ("", "wer")


def test_reasoning_ended_in_the_prompt():
    qwen3 = parser("qwen3")
    assert not qwen3.ended_in_prompt([5, IM_START, 6, 7])  # thinking: the output opens in the reasoning
    assert qwen3.ended_in_prompt([IM_START, 6, START, 8, END, 9])  # the template closed it (thinking off)
    assert not qwen3.ended_in_prompt([END, IM_START, 6])  # a </think> of an earlier turn does not count
    assert parser("qwen3", enable_thinking=False).ended_in_prompt([IM_START, 6])
    assert not parser("deepseek_r1").ended_in_prompt([IM_START, START, 6])
    # the grammar is told where the reasoning ends, unless it has already ended
    params = SamplingParams(structured_outputs=StructuredOutputsParams(json_object=True))
    gated = qwen3.constrain_after_reasoning(params, [IM_START, 6])
    assert gated.structured_outputs.reasoning_end_token_ids == [END, TOOL]
    assert qwen3.constrain_after_reasoning(params, [START, END]) is params
    assert qwen3.constrain_after_reasoning(SamplingParams(), [6]).structured_outputs is None


def test_unknown_parser_and_missing_tags_are_refused():
    with pytest.raises(ValueError, match="reasoning parser"):
        ServerConfig(reasoning_parser="nope")

    class NoTags:
        def get_vocab(self):
            return {"a": 1}

    with pytest.raises(ValueError, match="<think>"):
        ReasoningParser("deepseek_r1", NoTags())


class Matcher:
    def __init__(self):
        self.consumed = []

    def consume_tokens(self, token_ids):
        self.consumed += token_ids

    def is_stopped(self):
        return False

    def validate_tokens(self, token_ids):
        return len(token_ids)


def test_engine_grammar_starts_after_the_reasoning_end_token():
    done = Future()
    matcher = Matcher()
    done.set_result(matcher)
    request = StructuredOutputRequest(done, reasoning_end_token_ids=[END, TOOL])
    assert request.is_ready() and request.in_reasoning and request.is_mask_ready()
    request.accept_tokens([5, 6])
    assert matcher.consumed == [] and request.in_reasoning  # reasoning: the grammar does not move
    assert request.validate_tokens([7, END, 8]) == [7]  # drafts stop before the end: it is last of its step
    request.accept_tokens([7, END, 8, 9])
    assert not request.in_reasoning and matcher.consumed == [8, 9]  # the grammar starts after </think>
    request.accept_tokens([END])
    assert matcher.consumed == [8, 9, END]  # later ones are the grammar's

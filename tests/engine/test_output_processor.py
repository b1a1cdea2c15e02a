"""OutputProcessor without an engine: engine outputs in, RequestOutputs out (detokenized deltas, stop strings
found across chunk boundaries, n > 1 merged, aborts)."""

from __future__ import annotations

import pytest

from pagedllm.engine.output_processor import OutputProcessor, ParentRequest
from pagedllm.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from pagedllm.sampling_params import SamplingParams

PROMPT = [40, 41, 42]
TOKENS = [43, 44, 45, 46, 47, 48]


def _request(request_id: str, **params) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=PROMPT, eos_token_id=2, arrival_time=0.0,
                             sampling_params=SamplingParams(max_tokens=20, **params))


def _step(processor: OutputProcessor, *outputs: EngineCoreOutput):
    return processor.process_outputs(EngineCoreOutputs(outputs=list(outputs)))


def _out(request_id: str, tokens: list[int], finish: FinishReason | None = None) -> EngineCoreOutput:
    return EngineCoreOutput(request_id=request_id, new_token_ids=tokens, finish_reason=finish)


@pytest.mark.parametrize("chunks", [[1] * 6, [2, 2, 2], [3, 3], [1, 4, 1]])
def test_deltas_add_up_to_the_decoded_text(tiny_tokenizer, chunks):
    processor = OutputProcessor(tiny_tokenizer)
    processor.add_request(_request("r"), None, output_kind="delta")
    texts, start = [], 0
    for i, size in enumerate(chunks):
        last = i == len(chunks) - 1
        result = _step(processor, _out("r", TOKENS[start:start + size], FinishReason.LENGTH if last else None))
        start += size
        (output,) = result.request_outputs
        texts.append(output.outputs[0].text)
        assert output.finished == last
    assert "".join(texts) == tiny_tokenizer.decode(TOKENS)
    assert not processor.has_unfinished_requests()


@pytest.mark.parametrize("chunks", [[1] * 6, [2, 2, 2], [3, 3], [6]])
def test_a_stop_string_across_chunks_finishes_here_and_asks_the_engine_to_abort(tiny_tokenizer, chunks):
    full = tiny_tokenizer.decode(TOKENS)
    first = tiny_tokenizer.decode(TOKENS[:2])
    stop = full[len(first) - 1:len(first) + 1]  # the last character of token 2's text and the first of token 3's
    processor = OutputProcessor(tiny_tokenizer)
    processor.add_request(_request("r", stop=[stop]), None, output_kind="cumulative")
    start, final, aborted = 0, None, []
    for size in chunks:
        result = _step(processor, _out("r", TOKENS[start:start + size]))
        start += size
        aborted += result.reqs_to_abort
        if result.request_outputs and result.request_outputs[0].finished:
            final = result.request_outputs[0]
            break
    assert final is not None, "the stop string was not found"
    assert final.outputs[0].text == full[:full.index(stop)]
    assert (final.outputs[0].finish_reason, final.outputs[0].stop_reason) == ("stop", stop)
    assert aborted == ["r"] and not processor.has_unfinished_requests()


def test_n_children_merge_under_the_parent_id(tiny_tokenizer):
    processor = OutputProcessor(tiny_tokenizer)
    parent = ParentRequest("p", 2)
    for index in range(2):
        processor.add_request(_request(parent.child_id(index)), "prompt", parent, index, "cumulative")
    parent.pending = [_request("1_p")]
    result = _step(processor, _out("0_p", [43]))
    assert [r.request_id for r in result.reqs_to_add] == ["1_p"] and parent.pending == []
    _step(processor, _out("0_p", [44], FinishReason.LENGTH), _out("1_p", [50]))
    (final,) = _step(processor, _out("1_p", [51], FinishReason.LENGTH)).request_outputs
    assert final.request_id == "p" and final.finished and final.prompt == "prompt"
    assert [(c.index, c.token_ids) for c in final.outputs] == [(0, [43, 44]), (1, [50, 51])]


def test_abort_forgets_a_parent_with_its_children(tiny_tokenizer):
    processor = OutputProcessor(tiny_tokenizer)
    parent = ParentRequest("p", 2)
    for index in range(2):
        processor.add_request(_request(parent.child_id(index)), None, parent, index)
    processor.add_request(_request("other"), None)
    assert sorted(processor.abort_requests(["p"])) == ["0_p", "1_p"]
    assert list(processor.request_states) == ["other"]
    assert _step(processor, _out("0_p", [43])).request_outputs == []  # late outputs of aborted requests: dropped


def test_finish_requests_flushes_the_text_with_the_reason(tiny_tokenizer):
    processor = OutputProcessor(tiny_tokenizer)
    processor.add_request(_request("r"), None, output_kind="cumulative")
    _step(processor, _out("r", TOKENS[:3]))
    (output,), engine_ids = processor.finish_requests("r", "abort")
    assert engine_ids == ["r"] and output.finished
    assert output.outputs[0].finish_reason == "abort"
    assert output.outputs[0].text == tiny_tokenizer.decode(TOKENS[:3])


PADDED_ID = 500
"""A token id past the tiny tokenizer's vocabulary (384) that a model with a padded vocab_size (512) can sample:
the detokenizer raises TypeError on it (decoding it is issue 19's)."""


def test_a_request_whose_output_handling_raises_fails_alone(tiny_tokenizer, caplog):
    processor = OutputProcessor(tiny_tokenizer)
    processor.add_request(_request("bad"), None, output_kind="delta")
    processor.add_request(_request("good"), None, output_kind="delta")
    with caplog.at_level("ERROR", logger="pagedllm.engine.output_processor"):
        result = _step(processor, _out("bad", [43, PADDED_ID]), _out("good", TOKENS[:2]))
    bad, good = result.request_outputs
    assert bad.request_id == "bad" and bad.finished and "error id" in bad.error
    assert bad.outputs[0].finish_reason == "error"
    assert good.request_id == "good" and not good.finished and good.error is None
    assert good.outputs[0].text == tiny_tokenizer.decode(TOKENS[:2])
    assert result.reqs_failed == ["bad"] and result.reqs_to_abort == []
    assert list(processor.request_states) == ["good"]
    (record,) = caplog.records
    assert "request bad" in record.getMessage() and record.exc_info[0] is TypeError  # the traceback is logged
    # the failed request's late outputs are dropped; the other one goes on to its end
    result = _step(processor, _out("bad", [44]), _out("good", TOKENS[2:4], FinishReason.LENGTH))
    (good,) = result.request_outputs
    assert good.finished and good.outputs[0].text == tiny_tokenizer.decode(TOKENS)[len(tiny_tokenizer.decode(
        TOKENS[:2])):len(tiny_tokenizer.decode(TOKENS[:4]))]
    assert not processor.has_unfinished_requests()


def test_a_failing_child_fails_its_parent_with_every_sibling(tiny_tokenizer, monkeypatch):
    processor = OutputProcessor(tiny_tokenizer)
    parent = ParentRequest("p", 3)
    for index in range(3):
        processor.add_request(_request(parent.child_id(index)), "prompt", parent, index, "cumulative")
    parent.pending = [_request("2_p")]
    _step(processor, _out("0_p", [43]))  # child 0 has the prompt cached: 1 and 2 are released
    processor.add_request(_request("other"), None)
    state = processor.request_states["1_p"]
    monkeypatch.setattr(state.detokenizer, "update", lambda ids: 1 / 0)
    result = _step(processor, _out("0_p", [44]), _out("1_p", [50]), _out("other", [43]))
    before, failed, other = result.request_outputs  # child 0's output came first in the step
    assert before.request_id == "p" and before.error is None and not before.finished
    assert failed.request_id == "p" and failed.finished and failed.error
    assert sorted(result.reqs_failed) == ["0_p", "1_p", "2_p"]
    assert other.request_id == "other" and other.error is None
    assert list(processor.request_states) == ["other"]


def test_an_error_while_making_the_output_fails_the_request_alone(tiny_tokenizer, monkeypatch):
    """The detokenizer's flush at the end (get_next_output_text) raises too on a padded id."""
    processor = OutputProcessor(tiny_tokenizer)
    processor.add_request(_request("bad"), None, output_kind="cumulative")
    processor.add_request(_request("good"), None, output_kind="cumulative")
    monkeypatch.setattr(processor.request_states["bad"].detokenizer, "get_next_output_text",
                        lambda finished, delta: (_ for _ in ()).throw(RuntimeError("injected")))
    result = _step(processor, _out("bad", [43], FinishReason.LENGTH), _out("good", [43], FinishReason.LENGTH))
    assert [(o.request_id, o.error is not None, o.finished) for o in result.request_outputs] == [
        ("bad", True, True), ("good", False, True)]
    assert result.reqs_failed == ["bad"] and not processor.has_unfinished_requests()


def test_finish_requests_fails_a_request_whose_last_output_raises(tiny_tokenizer):
    """The drain timeout ends every open request: one that cannot be flushed fails instead of stopping the drain."""
    processor = OutputProcessor(tiny_tokenizer)
    processor.add_request(_request("r"), None, output_kind="cumulative")
    processor.request_states["r"].detokenizer._tokens.append(None)  # a padded id held back, as if undecoded
    (output,), engine_ids = processor.finish_requests("r", "abort")
    assert engine_ids == ["r"] and output.finished and "error id" in output.error
    assert not processor.has_unfinished_requests()

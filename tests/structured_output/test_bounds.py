"""The bounds of bounds.py: the constraints that crashed llguidance's native recursion are refused with a message
naming the limit, the sizes that worked before still work, the engine's compile worker compiles at the bounds,
and a fuzz of deep and wide schemas never crashes the validation."""

from __future__ import annotations

import os
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedllm.config import StructuredOutputsConfig
from pagedllm.sampling_params import StructuredOutputsParams as S
from pagedllm.structured_output import bounds
from pagedllm.structured_output.grammar import StructuredOutputError, check_grammar
from pagedllm.structured_output.manager import StructuredOutputManager


def ref_chain(n: int, nesting: int = 1) -> dict:
    """$defs d0 -> d1 -> ... -> dn: each an object (nested `nesting` deep) whose property refers to the next."""
    defs = {}
    for i in range(n):
        schema = {"$ref": f"#/$defs/d{i + 1}"}
        for _ in range(nesting):
            schema = {"type": "object", "properties": {"next": schema}, "required": ["next"]}
        defs[f"d{i}"] = schema
    defs[f"d{n}"] = {"type": "string"}
    return {"$defs": defs, "$ref": "#/$defs/d0"}


def rule_chain(n: int) -> str:
    return "start: r0\n" + "\n".join(f'r{i}: "t" r{i + 1}' for i in range(n)) + f'\nr{n}: "t"\n'


def _refused(params: S) -> StructuredOutputError:
    with pytest.raises(StructuredOutputError) as info:
        check_grammar(params, 30.0)
    return info.value


def test_the_crash_bodies_are_refused_naming_the_limit():
    error = _refused(S(json=ref_chain(1000)))  # crashed the server: 1,000 $refs deep
    assert error.param == "structured_outputs.json"
    assert "$ref chain depth" in str(error) and f"{bounds.MAX_REF_DEPTH:,}" in str(error)
    error = _refused(S(grammar=rule_chain(3000)))  # 3,000 chained rules
    assert error.param == "structured_outputs.grammar"
    assert "rule-reference depth" in str(error) and f"{bounds.MAX_RULE_DEPTH:,}" in str(error)
    # every other limit names itself and its value
    cases = [
        (S(json={"$defs": {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(600)}, "$ref": "#/$defs/d0"}),
         "$ref chain depth"),
        (S(choice=["x"] * (bounds.MAX_CHOICES + 1)), "number of choice entries"),
        (S(choice=["x" * 100_000] * 11), "size of the choice entries"),
        (S(json={"enum": list(range(bounds.MAX_CHOICES + 1))}), "entries of an enum"),
        (S(regex="a" * (bounds.MAX_REGEX_BYTES + 1)), "regex's size"),
        (S(grammar='start: "' + "a" * bounds.MAX_GRAMMAR_BYTES + '"'), "grammar's size"),
        (S(json={"type": "object", "description": "x" * bounds.MAX_SCHEMA_BYTES}), "JSON schema's size"),
        (S(json=_nested(bounds.MAX_SCHEMA_NESTING + 1)), "nesting"),
        (S(json=ref_chain(400, nesting=7)), "JSON schema's depth"),
        (S(grammar=_rule_cycle(bounds.MAX_RULE_DEPTH - 1)), None),  # a cycle counts once, in full: at the limit
        (S(grammar=_rule_cycle(bounds.MAX_RULE_DEPTH)), "rule-reference depth"),
        (S(grammar="start: a0\n" + "".join(f'a{i}: "x"\n' for i in range(bounds.MAX_GRAMMAR_RULES))),
         "number of grammar rules"),
    ]
    for params, words in cases:
        if words is None:
            assert check_grammar(params, 30.0)
            continue
        error = _refused(params)
        assert words in str(error) and "over this server's limit of" in str(error), str(error)


def _rule_cycle(n: int) -> str:
    """start -> r0 -> r1 -> ... -> r(n-1) -> r0: n + 1 rules on one chain."""
    return "start: r0\n" + "\n".join(f'r{i}: "x" r{(i + 1) % n} | "y"' for i in range(n)) + "\n"


def _nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels - 1):  # one JSON object per level
        schema = {"type": "array", "items": schema}
    return schema


def test_the_sizes_that_worked_before_still_work():
    assert check_grammar(S(json=ref_chain(200)), 30.0)
    assert check_grammar(S(grammar=rule_chain(2000)), 30.0)
    recursive = {"$defs": {"node": {"type": "object", "properties": {
        "value": {"type": "integer"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}},
        "$ref": "#/$defs/node"}
    assert check_grammar(S(json=recursive), 30.0)
    assert check_grammar(S(json={"properties": {"a": {"type": "string"}, "b": {"$ref": "#/properties/a"}}}), 30.0)


def test_the_engine_compiles_at_the_bounds_and_fails_past_them_alone(tiny_tokenizer):
    """The engine's compile worker (grammar made there, on its big stack): a schema at MAX_REF_DEPTH and near
    MAX_SCHEMA_DEPTH (which crashes a thread with the default 8 MiB stack), and a rule chain at MAX_RULE_DEPTH,
    compile; a request past the bounds that reaches the engine unchecked fails alone."""
    deepest = ref_chain(bounds.MAX_REF_DEPTH - 1, nesting=4)
    bounds.check_schema(deepest)
    manager = StructuredOutputManager(StructuredOutputsConfig(), lambda: tiny_tokenizer, len(tiny_tokenizer))
    try:
        past = manager.add_request(S(json=ref_chain(1000)))  # no exception in the engine's thread
        for params in (S(json=deepest), S(grammar=rule_chain(bounds.MAX_RULE_DEPTH - 2))):
            so = manager.add_request(params)
            matcher = so.future.result(timeout=120)  # may return before the compile's callback starts the mask
            assert so.is_ready()
            so.is_mask_ready()  # the first mask started (by the callback, or here: then never again by it)
            so.mask_rows([])  # waits for it: computed ahead on the mask thread with this matcher
            assert not matcher.is_error(), matcher.get_error()
        with pytest.raises(StructuredOutputError, match="chain depth"):
            past.future.result(timeout=60)
        assert past.is_ready() and past.failed
        assert manager._small_worker._thread.is_alive()
    finally:
        manager.shutdown()


def test_compiles_run_below_the_models_priority():
    """The engine's compile workers lower their own threads' priority (COMPILE_NICE), no other thread's."""
    executor = bounds.BigStackExecutor("nice-probe", nice=bounds.COMPILE_NICE)
    try:
        thread_nice = executor.submit(lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        assert thread_nice.result(timeout=10) == os.getpriority(os.PRIO_PROCESS, 0) + bounds.COMPILE_NICE
    finally:
        executor.shutdown(wait=True)


def test_the_big_stack_is_for_the_compile_thread_alone():
    executor = bounds.BigStackExecutor("probe", stack_bytes=64 << 20)
    assert executor.submit(lambda: threading.current_thread().name).result(timeout=10) == "probe"
    executor.shutdown(wait=True)
    assert threading.stack_size() == 0  # the process-wide default is restored for every other thread
    assert not executor._thread.is_alive()


_leaf = st.sampled_from([{"type": "string"}, {"type": "integer"}, {"type": "boolean"}, {"enum": ["a", "b"]},
                         {"$ref": "#"}, {"$ref": "#/$defs/d0"}, {"$ref": "#/nowhere"}, True])


def _extend(children):
    return st.one_of(
        st.builds(lambda c: {"type": "array", "items": c}, children),
        st.builds(lambda cs: {"type": "object", "properties": {f"p{i}": c for i, c in enumerate(cs)}},
                  st.lists(children, max_size=4)),
        st.builds(lambda cs: {"anyOf": cs}, st.lists(children, min_size=1, max_size=4)),
    )


def _deep(depth: int, leaf: dict) -> dict:
    for i in range(depth):
        leaf = {"type": "object", "properties": {f"k{i % 3}": leaf}} if i % 2 else {"type": "array", "items": leaf}
    return leaf


_schema = st.one_of(
    st.recursive(_leaf, _extend, max_leaves=30),
    st.builds(_deep, st.integers(0, 400), _leaf),  # past and within MAX_SCHEMA_NESTING
    st.builds(lambda n, k: ref_chain(n, k), st.integers(0, 1200), st.integers(1, 12)),  # $ref chains
    st.builds(lambda n: {"anyOf": [{"const": i} for i in range(n)]}, st.integers(1, 3000)),  # wide
    st.builds(lambda n: {"enum": list(range(n))}, st.integers(1, 2 * bounds.MAX_CHOICES)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(schema=_schema, defs=st.lists(_schema, max_size=3))
def test_fuzz_deep_and_wide_schemas_never_crash_the_validation(schema, defs):
    if isinstance(schema, dict) and defs:
        schema = {**schema, "$defs": {**{f"d{i}": d for i, d in enumerate(defs)}, **schema.get("$defs", {})}}
    try:
        assert check_grammar(S(json=schema), 60.0)
    except StructuredOutputError as e:  # the request's 400
        assert e.param == "structured_outputs.json" and str(e)

"""Structured outputs: validity and cost.

Validity: 10 JSON schemas (nested objects, bounded arrays, enums, anyOf, string patterns, required/optional
mixes) x N requests each, greedy and at temperature 1, through the offline LLM; every output must parse and
validate with `jsonschema`; regex outputs must full-match; choice outputs must be members. Prints a table of %
valid per constraint and temperature.

Cost (--cost): with the model's tokenizer and llguidance alone (no model), in CPU time of the calling thread (a
shared machine's wall time would measure its neighbours): grammar compile p50 cold (a new grammar) and cached
(the compile cache's copy), the mask fill p50 per constrained row per step (walking each schema along allowed
tokens), the matcher's advance per token, and the runner's application of 1 and 16 rows of masks.

    python benchmarks/structured_outputs_validity.py                      # SmolLM2, 50 requests per schema
    python benchmarks/structured_outputs_validity.py --num-requests 5 --cost
tests/llm/test_structured_outputs_validity.py runs the CI-size version on the tiny random model.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time

SCHEMAS: dict[str, dict] = {
    "nested_object": {
        "type": "object", "additionalProperties": False, "required": ["name", "address"],
        "properties": {"name": {"type": "string", "maxLength": 16},
                       "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"],
                                   "properties": {"city": {"type": "string", "maxLength": 16},
                                                  "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
    "bounded_int_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
                          "minItems": 1, "maxItems": 5},
    "enum": {"type": "object", "additionalProperties": False, "required": ["color", "size"],
             "properties": {"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": ["S", "M", "L", "XL"]}}},
    "any_of": {"type": "object", "additionalProperties": False, "required": ["id"],
               "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 10000},
                                               {"type": "string", "pattern": "^[a-f0-9]{8}$"}]}}},
    "string_pattern": {"type": "object", "additionalProperties": False, "required": ["code", "date"],
                       "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
                                      "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}}},
    "required_optional": {"type": "object", "additionalProperties": False, "required": ["title"],
                          "properties": {"title": {"type": "string", "maxLength": 24},
                                         "subtitle": {"type": "string", "maxLength": 24},
                                         "pages": {"type": "integer", "minimum": 1, "maximum": 2000},
                                         "draft": {"type": "boolean"}}},
    "array_of_objects": {"type": "array", "minItems": 1, "maxItems": 3,
                         "items": {"type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                                   "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"},
                                                  "qty": {"type": "integer", "minimum": 1, "maximum": 99}}}},
    "booleans_and_null": {"type": "object", "additionalProperties": False, "required": ["active", "note"],
                          "properties": {"active": {"type": "boolean"},
                                         "note": {"anyOf": [{"type": "null"}, {"type": "string", "maxLength": 12}]}}},
    "nested_arrays": {"type": "array", "minItems": 2, "maxItems": 2,
                      "items": {"type": "array", "minItems": 2, "maxItems": 2,
                                "items": {"type": "integer", "minimum": -9, "maximum": 9}}},
    "const_and_ranges": {"type": "object", "additionalProperties": False, "required": ["version", "score", "tags"],
                         "properties": {"version": {"const": "v1"},
                                        "score": {"type": "integer", "minimum": 0, "maximum": 100},
                                        "tags": {"type": "array", "maxItems": 3,
                                                 "items": {"enum": ["a", "b", "c"]}}}},
}
REGEX = r"[A-Z][a-z]{2,8} [0-9]{1,3}"
CHOICES = ["positive", "negative", "neutral"]


def _messages(what: str) -> list[dict]:
    return [{"role": "user", "content": f"Reply with {what} only."}]


def run_validity(llm, num_requests: int, max_tokens: int, temperatures=(0.0, 1.0)) -> dict[str, dict[float, tuple]]:
    """{constraint: {temperature: (valid, total, first invalid output or None)}} through llm.chat."""
    import jsonschema

    from pagedllm import SamplingParams
    from pagedllm.sampling_params import StructuredOutputsParams as S

    cases = [(f"json:{name}", S(json=schema, disable_any_whitespace=True), f"a JSON {name.replace('_', ' ')}")
             for name, schema in SCHEMAS.items()]
    cases += [("regex", S(regex=REGEX), "a capitalized word and a number"),
              ("choice", S(choice=CHOICES), "the sentiment of 'I like it'")]

    def valid(name: str, text: str) -> bool:
        if name == "regex":
            return re.fullmatch(REGEX, text) is not None
        if name == "choice":
            return text in CHOICES
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[name.split(":", 1)[1]])
        except (ValueError, jsonschema.ValidationError):
            return False
        return True

    results: dict[str, dict[float, tuple]] = {}
    for temperature in temperatures:
        conversations, params, names = [], [], []
        for name, so, what in cases:
            for i in range(num_requests):
                conversations.append(_messages(what))
                params.append(SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=i,
                                             structured_outputs=so))
                names.append(name)
        outputs = llm.chat(conversations, params, use_tqdm=False)
        for name, output in zip(names, outputs, strict=True):
            ok, total, bad = results.setdefault(name, {}).get(temperature, (0, 0, None))
            text = output.outputs[0].text
            good = valid(name, text)
            results[name][temperature] = (ok + good, total + 1, bad if good or bad is not None else text)
    return results


def print_validity(results: dict[str, dict[float, tuple]]) -> None:
    temperatures = sorted({t for per in results.values() for t in per})
    print("| constraint | " + " | ".join(f"valid at T={t:g}" for t in temperatures) + " |")
    print("| --- |" + " --- |" * len(temperatures))
    for name, per in results.items():
        cells = [f"{100 * per[t][0] / per[t][1]:.0f}% ({per[t][0]}/{per[t][1]})" for t in temperatures]
        print(f"| {name} | " + " | ".join(cells) + " |")
    for name, per in results.items():
        for t, (_, _, bad) in per.items():
            if bad is not None:
                print(f"first invalid {name} at T={t:g}: {bad[:200]!r}")


def measure_cost(tokenizer, vocab_size: int, repeats: int = 3) -> dict[str, float]:
    """Compile p50 cold / cached and mask fill p50 per row per step (microseconds), llguidance alone."""
    import numpy as np

    from pagedllm.sampling_params import StructuredOutputsParams as S
    from pagedllm.structured_output.backend_guidance import GuidanceBackend
    from pagedllm.structured_output.grammar import grammar_of

    backend = GuidanceBackend(tokenizer, vocab_size)
    bitmask = backend.allocate_bitmask(1)
    cold, cached, fill, accept = [], [], [], []
    rng = np.random.default_rng(0)
    for round_index in range(repeats):
        for name, schema in SCHEMAS.items():
            # a grammar llguidance has not seen (its own caches are per grammar): a unique title per round
            grammar = grammar_of(S(json={**schema, "title": f"{name}-{round_index}"}, disable_any_whitespace=True))
            start = time.thread_time()
            template = backend.compile(grammar)
            backend.fill_bitmask([(template, 0, ())], bitmask)  # the first mask finishes the lazy part of a compile
            cold.append(time.thread_time() - start)
            start = time.thread_time()
            matcher = template.deep_copy()
            cached.append(time.thread_time() - start)
            for _ in range(200):  # a random walk through allowed tokens: every step's mask is a real one
                start = time.thread_time()
                backend.fill_bitmask([(matcher, 0, ())], bitmask)
                fill.append(time.thread_time() - start)
                allowed = np.flatnonzero(np.unpackbits(bitmask[0].view(np.uint8), bitorder="little"))
                token = int(rng.choice(allowed))
                start = time.thread_time()
                matcher.consume_token(token)
                accept.append(time.thread_time() - start)
                if matcher.is_stopped() or matcher.is_error():
                    break
    apply_us = {rows: 1e6 * _apply_p50(rows, vocab_size) for rows in (1, 16)}
    return {"compile_cold_p50_ms": 1000 * statistics.median(cold),
            "compile_cached_p50_ms": 1000 * statistics.median(cached),
            "mask_fill_p50_us": 1e6 * statistics.median(fill), "mask_fill_p99_us": 1e6 * _p99(fill),
            "accept_p50_us": 1e6 * statistics.median(accept), "steps": len(fill),
            "apply_1_row_p50_us": apply_us[1], "apply_16_rows_p50_us": apply_us[16]}


def _apply_p50(num_rows: int, vocab_size: int) -> float:
    """Seconds the runner takes to mask num_rows rows of [num_rows, vocab] logits (apply_grammar_bitmask)."""
    import numpy as np
    import torch

    from pagedllm.layers.sampling.grammar_bitmask import apply_grammar_bitmask

    rng = np.random.default_rng(0)
    bitmask = rng.integers(-(2**31), 2**31, size=(num_rows, (vocab_size + 31) // 32), dtype=np.int64).astype(np.int32)
    req_ids = [str(i) for i in range(num_rows)]
    rows = {r: i for i, r in enumerate(req_ids)}
    times = []
    for _ in range(50):
        logits = torch.randn(num_rows, vocab_size)
        start = time.thread_time()
        apply_grammar_bitmask(logits, bitmask, rows, req_ids)
        times.append(time.thread_time() - start)
    return statistics.median(times)


def _p99(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(0.99 * len(values)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model path (default: the embedded SmolLM2)")
    parser.add_argument("--num-requests", type=int, default=50, help="requests per constraint and temperature")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--cost", action="store_true", help="also measure compile and mask fill times")
    parser.add_argument("--cost-only", action="store_true")
    args = parser.parse_args()
    if args.cost_only:  # the tokenizer is all it needs
        from pagedllm.tokenizer import get_tokenizer

        tokenizer = get_tokenizer(args.model)
        print(json.dumps(measure_cost(tokenizer, len(tokenizer)), indent=1))
        return
    from pagedllm import LLM

    llm = LLM(args.model, dtype="float32", kv_cache_memory=512 << 20)
    start = time.perf_counter()
    print_validity(run_validity(llm, args.num_requests, args.max_tokens))
    print(f"validity: {time.perf_counter() - start:.0f} s")
    if args.cost:
        engine = llm.llm_engine
        print(json.dumps(measure_cost(engine.tokenizer, engine.engine_core.vocab_size), indent=1))

if __name__ == "__main__":
    main()

"""Structured outputs: a request's JSON schema, regex, choice or grammar enforced token by token (vLLM's
`vllm/v1/structured_output`).

- `grammar.py`: StructuredOutputsParams -> the backend's grammar text, and its validation (the frontend's 400s);
- `bounds.py`: the size and depth limits checked before llguidance sees a constraint, and the big-stack threads
  its compiles run on;
- `backend_guidance.py`: llguidance, the one backend: tokenizer vocabulary, compile, bitmask fill;
- `request.py`: one request's grammar (compiled off the busy loop) and its matcher;
- `manager.py`: the compile worker and cache, and the bitmask of each step's constrained rows.

The runner applies the bitmask to the logits (`layers/sampling/grammar_bitmask.py`).
"""

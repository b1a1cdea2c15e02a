"""Fault injection for the reliability tests, kept out of the package: a process started with this folder on
PYTHONPATH and `PAGEDLLM_FAULT_INJECT=KIND:after_steps=N[,times=K][,seconds=S]` gets a model forward pass that
misbehaves after N successful steps, K times (default 1):

- raise_in_forward: raises (the step's requests fail with an error, the engine keeps serving);
- hang_in_forward: blocks the busy loop forever;
- sleep_in_forward: makes the step last S seconds longer (a long step that is not a hang).

`step_seconds=T` (any kind) makes every step T seconds longer: requests sent at once are all in flight before
step N even when busy cores stagger their arrival (the tiny model's steps take ~1 ms).

and in the API server's output path:

- `raise_in_detokenizer[:seed=S][,after_tokens=N]`: the detokenizer of a request sampled with seed S (any request
  without `seed`) raises TypeError once it has been given more than N tokens (default 0), as a padded-vocab
  token id made it raise before it decoded to "" (one request's output handling fails);
- `raise_in_output_loop:after_steps=N`: the API server's handling of the engine's outputs raises at the N+1-th
  step (the output loop itself fails).

Python imports `sitecustomize` at start-up. This one, only when the variable is set, waits for the module to
wrap to be imported (`pagedllm.engine.core`: only the engine-core process imports it; `pagedllm.engine.detokenizer`
and `pagedllm.engine.async_llm`: the API server) and wraps it. `tests/server_process.serve_env` puts this folder
on PYTHONPATH when a test asks for a fault.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import logging
import os
import sys
import time

FAULT_INJECT_ENV = "PAGEDLLM_FAULT_INJECT"
ENGINE_MODULE = "pagedllm.engine.core"
FORWARD_KINDS = ("raise_in_forward", "hang_in_forward", "sleep_in_forward")
logger = logging.getLogger("pagedllm.fault_injection")


def _parse(spec: str) -> tuple[str, dict[str, str]]:
    kind, _, options = spec.partition(":")
    return kind, dict(item.split("=", 1) for item in options.split(",") if item)


def install_fault(engine_core, spec: str) -> None:
    """Wrap the runner's execute_model per a PAGEDLLM_FAULT_INJECT spec (see the module docstring)."""
    kind, opts = _parse(spec)
    after_steps, times = int(opts.get("after_steps", 0)), int(opts.get("times", 1))
    seconds = float(opts.get("seconds", 0))
    step_seconds = float(opts.get("step_seconds", 0))  # every step this much longer (a real model's step length)
    if kind not in FORWARD_KINDS:
        raise ValueError(f"unknown {FAULT_INJECT_ENV} kind {kind!r}")
    runner = engine_core.runner
    execute_model = runner.execute_model
    calls = {"n": 0}

    def faulty_execute_model(scheduler_output, grammar=None):
        calls["n"] += 1
        if step_seconds:
            time.sleep(step_seconds)
        if after_steps < calls["n"] <= after_steps + times:
            if calls["n"] <= after_steps + 3:  # the first few: a fault on every step would flood the log
                logger.warning("%s: injecting %s at step %d", FAULT_INJECT_ENV, kind, calls["n"])
            if kind == "raise_in_forward":
                raise RuntimeError("injected fault in the forward pass")
            if kind == "sleep_in_forward":
                time.sleep(seconds)
                return execute_model(scheduler_output, grammar)
            while True:
                time.sleep(3600)
        return execute_model(scheduler_output, grammar)

    runner.execute_model = faulty_execute_model


def _wrap_engine_core(module) -> None:
    engine_core_init = module.EngineCore.__init__

    def __init__(self, config, *args, **kwargs) -> None:
        engine_core_init(self, config, *args, **kwargs)
        install_fault(self, os.environ[FAULT_INJECT_ENV])

    module.EngineCore.__init__ = __init__


def _wrap_detokenizer(module) -> None:
    """raise_in_detokenizer: see the module docstring."""
    _, opts = _parse(os.environ[FAULT_INJECT_ENV])
    seed = int(opts["seed"]) if "seed" in opts else None
    after_tokens = int(opts.get("after_tokens", 0))
    cls = module.IncrementalDetokenizer
    init, update = cls.__init__, cls.update

    def __init__(self, tokenizer, prompt_token_ids, params) -> None:
        init(self, tokenizer, prompt_token_ids, params)
        self._fault_armed = seed is None or params.seed == seed

    def faulty_update(self, new_token_ids):
        if self._fault_armed and len(self.output_token_ids) + len(new_token_ids) > after_tokens:
            logger.warning("%s: injecting raise_in_detokenizer", FAULT_INJECT_ENV)
            raise TypeError("injected fault in the detokenizer")
        return update(self, new_token_ids)

    cls.__init__, cls.update = __init__, faulty_update


def _wrap_output_loop(module) -> None:
    """raise_in_output_loop: see the module docstring."""
    _, opts = _parse(os.environ[FAULT_INJECT_ENV])
    after_steps = int(opts.get("after_steps", 0))
    on_outputs = module.AsyncLLM._on_outputs
    calls = {"n": 0}

    def faulty_on_outputs(self, replica, message):
        calls["n"] += 1
        if calls["n"] == after_steps + 1:
            logger.warning("%s: injecting raise_in_output_loop at step %d", FAULT_INJECT_ENV, calls["n"])
            raise RuntimeError("injected fault in the output loop")
        return on_outputs(self, replica, message)

    module.AsyncLLM._on_outputs = faulty_on_outputs


WRAPPERS = {"raise_in_detokenizer": ("pagedllm.engine.detokenizer", _wrap_detokenizer),
            "raise_in_output_loop": ("pagedllm.engine.async_llm", _wrap_output_loop),
            **{kind: (ENGINE_MODULE, _wrap_engine_core) for kind in FORWARD_KINDS}}


class _ImportHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on the import of `module_name`, runs the real import, then `wrap`s the module."""

    def __init__(self, module_name: str, wrap) -> None:
        self.module_name = module_name
        self.wrap = wrap

    def find_spec(self, name, path, target=None):
        if name != self.module_name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module) -> None:
            exec_module(module)
            self.wrap(module)

        spec.loader.exec_module = exec_and_wrap
        return spec


if os.environ.get(FAULT_INJECT_ENV):
    _kind = _parse(os.environ[FAULT_INJECT_ENV])[0]
    if _kind not in WRAPPERS:
        raise ValueError(f"unknown {FAULT_INJECT_ENV} kind {_kind!r}")
    sys.meta_path.insert(0, _ImportHook(*WRAPPERS[_kind]))

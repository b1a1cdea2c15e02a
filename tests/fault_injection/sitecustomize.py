"""Fault injection for the reliability tests, kept out of the package: a process started with this folder on
PYTHONPATH and `PAGEDLLM_FAULT_INJECT=KIND:after_steps=N[,times=K][,seconds=S]` gets a model forward pass that
misbehaves after N successful steps, K times (default 1):

- raise_in_forward: raises (the step's requests fail with an error, the engine keeps serving);
- hang_in_forward: blocks the busy loop forever;
- sleep_in_forward: makes the step last S seconds longer (a long step that is not a hang).

Python imports `sitecustomize` at start-up. This one, only when the variable is set, waits for
`pagedllm.engine.core` to be imported (only the engine-core process imports it) and wraps EngineCore so that
each new engine's runner gets the faulty execute_model. `tests/server_process.serve_env` puts this folder on
PYTHONPATH when a test asks for a fault.
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
logger = logging.getLogger("pagedllm.fault_injection")


def install_fault(engine_core, spec: str) -> None:
    """Wrap the runner's execute_model per a PAGEDLLM_FAULT_INJECT spec (see the module docstring)."""
    kind, _, options = spec.partition(":")
    opts = dict(item.split("=", 1) for item in options.split(",") if item)
    after_steps, times = int(opts.get("after_steps", 0)), int(opts.get("times", 1))
    seconds = float(opts.get("seconds", 0))
    if kind not in ("raise_in_forward", "hang_in_forward", "sleep_in_forward"):
        raise ValueError(f"unknown {FAULT_INJECT_ENV} kind {kind!r}")
    runner = engine_core.runner
    execute_model = runner.execute_model
    calls = {"n": 0}

    def faulty_execute_model(scheduler_output, grammar=None):
        calls["n"] += 1
        if after_steps < calls["n"] <= after_steps + times:
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


class _EngineCoreHook(importlib.abc.MetaPathFinder):
    """Finds nothing itself: on the import of pagedllm.engine.core, runs the real import, then wraps."""

    def find_spec(self, name, path, target=None):
        if name != ENGINE_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        exec_module = spec.loader.exec_module

        def exec_and_wrap(module) -> None:
            exec_module(module)
            _wrap_engine_core(module)

        spec.loader.exec_module = exec_and_wrap
        return spec


if os.environ.get(FAULT_INJECT_ENV):
    sys.meta_path.insert(0, _EngineCoreHook())

"""Every environment variable pagedllm reads, declared once with its default and meaning (as vllm/envs.py does).

Read lazily: `envs.VLLM_API_KEY` reads the environment when it is asked for, so a test's monkeypatch.setenv and a
child process's environment hold. No other module reads os.environ (tests/core/test_envs.py checks it); passing the
environment on to a child process (`{**os.environ, ...}`) is not a read.

vLLM's variables that pagedllm honours: VLLM_API_KEY, VLLM_LOGGING_LEVEL, VLLM_CONFIGURE_LOGGING,
VLLM_SERVER_DEV_MODE, VLLM_ENGINE_READY_TIMEOUT_S, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES,
VLLM_ALLOW_RUNTIME_LORA_UPDATING, VLLM_NIXL_SIDE_CHANNEL_HOST, VLLM_NIXL_SIDE_CHANNEL_PORT,
VLLM_NIXL_ABORT_REQUEST_TIMEOUT (same names and meanings).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # for type checkers: the attributes module __getattr__ serves
    VLLM_API_KEY: str | None
    VLLM_LOGGING_LEVEL: str
    VLLM_CONFIGURE_LOGGING: bool
    VLLM_SERVER_DEV_MODE: bool
    VLLM_ALLOW_RUNTIME_LORA_UPDATING: bool
    VLLM_ENGINE_READY_TIMEOUT_S: float | None
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES: bool
    VLLM_NIXL_SIDE_CHANNEL_HOST: str | None
    VLLM_NIXL_SIDE_CHANNEL_PORT: int | None
    VLLM_NIXL_ABORT_REQUEST_TIMEOUT: float
    RAY_ADDRESS: str | None
    OMP_NUM_THREADS: int | None
    OPENAI_API_KEY: str | None
    CC: str
    XDG_CACHE_HOME: str | None
    PAGEDLLM_CACHE_DIR: str | None
    PAGEDLLM_NATIVE_KERNELS: bool
    PAGEDLLM_NATIVE_STEP: bool
    PAGEDLLM_CPU_SHM_ALLREDUCE: bool
    PAGEDLLM_DP_ROUTER: str | None
    PAGEDLLM_API_PROFILE: str | None
    PROMETHEUS_MULTIPROC_DIR: str | None
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: str


def _str(name: str, default: str | None = None) -> Callable[[], str | None]:
    return lambda: os.environ.get(name) or default


def _switch(name: str, default: bool) -> Callable[[], bool]:
    """"0" is off; anything else set is on (pagedllm's switches and vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)."""
    return lambda: os.environ.get(name, "1" if default else "0") != "0"


def _flag01(name: str, default: bool = False) -> Callable[[], bool]:
    """vLLM's bool(int(os.getenv(NAME, default))): an integer, non-zero is on."""
    def read() -> bool:
        value = os.environ.get(name, "").strip() or ("1" if default else "0")
        try:
            return bool(int(value))
        except ValueError:
            raise ValueError(f"{name} must be an integer (0 or 1), got {value!r}.") from None
    return read


def _number(name: str, kind: type) -> Callable[[], Any]:
    def read() -> Any:
        value = os.environ.get(name, "").strip()
        if not value:
            return None
        try:
            return kind(value)
        except ValueError:
            raise ValueError(f"{name} must be a number, got {value!r}.") from None
    return read


ENVIRONMENT_VARIABLES: dict[str, tuple[Callable[[], Any], str]] = {
    # vLLM's, with vLLM's meaning
    "VLLM_API_KEY": (_str("VLLM_API_KEY"), "The --api-key when the flag is not given (keeps the key out of ps)."),
    "VLLM_LOGGING_LEVEL": (lambda: (os.environ.get("VLLM_LOGGING_LEVEL") or "INFO").upper(),
                           "`pagedllm serve`'s log level (DEBUG, INFO, WARNING, ERROR, CRITICAL); default INFO."),
    "VLLM_CONFIGURE_LOGGING": (_flag01("VLLM_CONFIGURE_LOGGING", True),
                               "0: `pagedllm serve` leaves Python's logging as it finds it."),
    "VLLM_SERVER_DEV_MODE": (lambda: (os.environ.get("VLLM_SERVER_DEV_MODE") or "0").strip().lower()
                             not in ("", "0", "false"),
                             "1: serve vLLM's development routes (/reset_prefix_cache, /sleep, /wake_up, "
                             "/is_sleeping), as --enable-debug-routes does (vLLM reads an integer; true is taken "
                             "too)."),
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": (lambda: (os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") or "0").strip()
                                         .lower() in ("1", "true"),
                                         "1: serve /v1/load_lora_adapter and /v1/unload_lora_adapter (adapters "
                                         "loaded and unloaded at run time), as vLLM does."),
    "VLLM_ENGINE_READY_TIMEOUT_S": (_number("VLLM_ENGINE_READY_TIMEOUT_S", float),
                                    "Seconds to wait for the engine core to be ready: --engine-startup-timeout's "
                                    "default when set (vLLM's default 600 is pagedllm's too)."),
    "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": (_switch("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", True),
                                            "0: KV events carry whole block digests; else 64-bit integers."),
    "VLLM_NIXL_SIDE_CHANNEL_HOST": (_str("VLLM_NIXL_SIDE_CHANNEL_HOST"),
                                    "The P/D connector's (NixlConnector's) side-channel address, instead of "
                                    "--kv-transfer-config kv_ip."),
    "VLLM_NIXL_SIDE_CHANNEL_PORT": (_number("VLLM_NIXL_SIDE_CHANNEL_PORT", int),
                                    "The P/D connector's side-channel port, instead of --kv-transfer-config "
                                    "kv_port (each data-parallel rank listens on port + rank * tp size)."),
    "VLLM_NIXL_ABORT_REQUEST_TIMEOUT": (lambda: _number("VLLM_NIXL_ABORT_REQUEST_TIMEOUT", float)() or 480.0,
                                        "Seconds a P/D producer keeps a finished request's KV blocks for a "
                                        "consumer that has not read them (default 480), then frees them."),
    # other tools'
    "RAY_ADDRESS": (_str("RAY_ADDRESS"), "The Ray cluster the ray backend joins when --ray-address is not given."),
    "OMP_NUM_THREADS": (lambda: _number("OMP_NUM_THREADS", int)() or None,
                        "CPU threads to share among data-parallel replicas (default: this process's CPUs)."),
    "OPENAI_API_KEY": (_str("OPENAI_API_KEY"), "`pagedllm bench serve` sends it as the bearer token."),
    "CC": (_str("CC", "cc"), "The C compiler that builds the native CPU kernels."),
    "XDG_CACHE_HOME": (_str("XDG_CACHE_HOME"), "The cache root (default ~/.cache) when PAGEDLLM_CACHE_DIR is unset."),
    "PROMETHEUS_MULTIPROC_DIR": (_str("PROMETHEUS_MULTIPROC_DIR"),
                                 "prometheus_client's multiprocess folder: with --api-server-count > 1 the API "
                                 "servers write their metrics there and /metrics sums them (default: a temporary "
                                 "folder made by `pagedllm serve`, removed at exit)."),
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": (_str("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc"),
                                           "--otlp-traces-endpoint's protocol: grpc (default) or http/protobuf."),
    # pagedllm's own
    "PAGEDLLM_CACHE_DIR": (_str("PAGEDLLM_CACHE_DIR"), "Where built kernels are kept (default ~/.cache/pagedllm)."),
    "PAGEDLLM_NATIVE_KERNELS": (_switch("PAGEDLLM_NATIVE_KERNELS", True), "0: no native CPU kernels (torch paths)."),
    "PAGEDLLM_NATIVE_STEP": (_switch("PAGEDLLM_NATIVE_STEP", True),
                             "0: never build the Llama native step (the module path runs every step)."),
    "PAGEDLLM_CPU_SHM_ALLREDUCE": (_switch("PAGEDLLM_CPU_SHM_ALLREDUCE", True),
                                   "0: tensor-parallel all-reduce over gloo only, not shared memory."),
    "PAGEDLLM_DP_ROUTER": (_str("PAGEDLLM_DP_ROUTER"), "The data-parallel routing policy (default prefix)."),
    "PAGEDLLM_API_PROFILE": (_str("PAGEDLLM_API_PROFILE"),
                             "A path: the API server's event loop runs under cProfile and its stats go there."),
}
"""name -> (how it is read, what it means). A new variable is a line here."""


def __getattr__(name: str) -> Any:
    if name in ENVIRONMENT_VARIABLES:
        return ENVIRONMENT_VARIABLES[name][0]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(ENVIRONMENT_VARIABLES)


def is_set(name: str) -> bool:
    """Whether a declared variable is in the environment (for defaults that apply only when it is)."""
    if name not in ENVIRONMENT_VARIABLES:
        raise KeyError(name)
    return name in os.environ


def with_prefix(prefix: str) -> dict[str, str]:
    """The environment's variables whose names start with `prefix` (PAGEDLLM_: passed on to Ray workers)."""
    return {k: v for k, v in os.environ.items() if k.startswith(prefix)}

"""The API server's configuration (`ServerConfig`: one field per `pagedllm serve` server flag, one docstring per
field, from which config/engine.py generates the flags)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pagedllm.config.bounds import SERVER_BOUNDS, check_bounds
from pagedllm.config.lora import parse_lora_modules


@dataclass
class ServerConfig:
    """The API server's settings: one field per `pagedllm serve` server flag, with its default. Validated on
    construction (ValueError with a message for the user)."""

    host: str | None = None
    """Host name or address to listen on; default: all interfaces."""
    port: int = 8000
    """Port to listen on."""
    api_key: str | None = None
    """Require `Authorization: Bearer KEY` on every route except /health (and /metrics unless
    --protect-metrics). Several keys (one per tenant): comma-separated; a blank key anywhere in the list is
    refused at start-up. Default: the VLLM_API_KEY environment variable, if set (keeps the key out of ps)."""
    cache_salt_from_api_key: bool = False
    """Derive each request's cache_salt on the server from the caller's API key (HMAC-SHA256 under a
    per-process secret, combined with any client cache_salt), so tenants never share prefix-cache blocks,
    even when a client sends no salt. Needs --api-key."""
    protect_metrics: bool = False
    """Make --api-key guard /metrics too."""
    disable_log_requests: bool = False
    """Do not log each request's id, prompt length and sampling parameters."""
    disable_log_stats: bool = False
    """Do not log throughput, queue and KV-cache statistics every 10 seconds."""
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "info"
    """Log level of uvicorn (access log, server events)."""
    health_check_timeout: float = 10.0
    """Seconds the engine-core process may take to answer /health before it answers 503. The engine core
    answers during a step, so a long step (a long prefill chunk) does not fail /health."""
    engine_hang_timeout: float = 300.0
    """Seconds with unfinished requests in the engine core and no step finished before it is declared hung:
    its open requests fail, /health answers 503 and the server exits (0: never). Requests the engine has
    finished do not count, however slowly their clients read; a slow step on a busy machine must not kill
    the server."""
    max_buffered_outputs: int = 4096
    """Most outputs (one per choice per engine step) a streaming request may have waiting for its client;
    beyond, the client is taken as stalled and the request is aborted, its KV blocks freed."""
    drain_timeout: float = 30.0
    """Seconds SIGTERM waits for open requests to finish before aborting them and exiting."""
    engine_startup_timeout: float = 600.0
    """Seconds to wait for the engine core to load the model and report ready."""
    engine_death_exit_delay: float = 3.0
    """Seconds the server keeps answering 503 after the engine core dies, before it exits."""
    max_n: int = 128
    """Largest `n` (choices per request) accepted; checked before anything else is done."""
    max_prompts: int = 1024
    """Most prompts in one /v1/completions request (a list of prompts); checked before tokenization."""
    max_choices: int = 1024
    """Most choices in one request: prompts x n (64 prompts with n=128 are 8,192 sequences to generate); HTTP 400
    beyond, checked before tokenization."""
    max_logit_bias: int = 1024
    """Most logit_bias entries in one request."""
    max_stop: int = 64
    """Most stop strings (and, separately, stop_token_ids) in one request."""
    chat_template_timeout: float = 1.0
    """Seconds a chat template may take to render before the request is rejected (HTTP 400)."""
    max_chat_template_chars: int = 1 << 20
    """Most characters a chat template may render (or build in one value) before HTTP 400."""
    trust_request_chat_template: bool = False
    """Accept a chat template sent in a request (`chat_template`, or `chat_template_kwargs.chat_template`);
    without this flag such a request is refused with HTTP 400, as vLLM does. A request's template is code:
    it is compiled and rendered in a child process with a memory limit, killed past --chat-template-timeout."""
    chat_template: str | None = None
    """The chat template to use instead of the model's own: a file path, the template text, or the name of a
    template shipped with pagedllm (`tool_chat_template_hermes.jinja`: Hermes-style tool calling for ChatML
    models such as SmolLM2)."""
    enable_auto_tool_choice: bool = False
    """Accept `tool_choice: "auto"` (the default when a request has tools): the --tool-call-parser reads tool
    calls out of the model's free output."""
    tool_call_parser: str | None = None
    """How tool calls are read out of the output with `tool_choice: "auto"` (vLLM's parser names): `hermes`
    (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`), `llama3_json` or `llama4_json` (`{"name": ...,
    "parameters": ...}`, `;`-separated, optionally after `<|python_tag|>`), `mistral` (`[TOOL_CALLS][{"name":
    ..., "arguments": ...}]`, or `[TOOL_CALLS]NAME{...}` from tokenizer v11 on), `qwen3_xml` or `qwen3_coder`
    (`<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>`)."""
    exclude_tools_when_tool_choice_none: bool = False
    """Do not pass a request's tools to the chat template when its tool_choice is `none`."""
    max_request_bytes: int = 16 << 20
    """Largest request body accepted, in bytes (HTTP 413 beyond; chunked bodies are counted as they
    arrive)."""
    max_header_bytes: int = 64 << 10
    """Largest request head (request line and headers) accepted, in bytes (HTTP 431 beyond)."""
    max_connections: int = 4096
    """Most open client connections (kept below the open-file limit, which start-up raises to its hard limit).
    Beyond, a new connection closes the oldest one that is not inside a request (its head not complete, or idle
    between keep-alive requests); when every one is inside a request, the new one may still ask for /health and
    /metrics, and gets HTTP 503 for anything else."""
    header_read_timeout: float = 10.0
    """Seconds a connection has to deliver a request's head (request line and headers) from when it opens,
    or from its first byte after a keep-alive pause; then HTTP 408 and the connection is closed."""
    body_read_timeout: float = 60.0
    """Seconds a request's body has to arrive in full after its head; then the connection is closed."""
    enable_debug_routes: bool = False
    """Serve GET /debug/kv_cache (free and total KV blocks, running and waiting requests) for tests."""
    lora_modules: list[str] | None = None
    """LoRA adapters served at start-up (needs --enable-lora), each `name=path` or JSON
    '{"name": "sql", "path": "/adapters/sql", "base_model_name": "base"}'; several: `--lora-modules a=/p b=/q`.
    A request selects one by its name in `model`; /v1/models lists each with its base model as `parent`."""

    def __post_init__(self) -> None:
        parse_api_keys(self.api_key)
        if self.cache_salt_from_api_key and self.api_key is None:
            raise ValueError("--cache-salt-from-api-key needs --api-key (or VLLM_API_KEY): without a key there is "
                             "no tenant to derive a salt from.")
        check_tool_flags(self.enable_auto_tool_choice, self.tool_call_parser)
        check_bounds(self, SERVER_BOUNDS)
        parse_lora_modules(self.lora_modules)

    @property
    def api_keys(self) -> list[str]:
        """The keys of --api-key: any of them is accepted as `Authorization: Bearer KEY`; []: no key needed."""
        return parse_api_keys(self.api_key)


TOOL_CALL_PARSERS = {
    "hermes": "hermes",
    "llama3_json": "llama3_json",
    "llama4_json": "llama3_json",
    "mistral": "mistral",
    "qwen3_xml": "qwen3_xml",
    "qwen3_coder": "qwen3_xml",
}
"""The tool call parsers: each --tool-call-parser value (vLLM's names) and its module under
`pagedllm.entrypoints.openai.tool_parsers` (one module a format; a new parser is a module and a line here)."""


def check_tool_flags(enable_auto_tool_choice: bool, tool_call_parser: str | None) -> None:
    """vLLM's start-up checks of --enable-auto-tool-choice and --tool-call-parser (ValueError)."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"--tool-call-parser {tool_call_parser!r} is not a registered tool call parser; the "
                         f"registered ones are {', '.join(TOOL_CALL_PARSERS)}.")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser to be set.")


def parse_api_keys(value: str | None, source: str = "--api-key") -> list[str]:
    """The keys of --api-key (or VLLM_API_KEY): comma-separated, each stripped; None: no key needed.

    Raises ValueError for a blank key anywhere in the list (`" "`, `"a,,b"`, `"a, "`): dropping it would
    leave authentication off, or weaker than asked, without a word."""
    if value is None:
        return []
    keys = [key.strip() for key in value.split(",")]
    if not all(keys):
        raise ValueError(f"{source} contains a blank key: every comma-separated key must be non-empty (leave "
                         f"{source} unset to serve without authentication).")
    return keys

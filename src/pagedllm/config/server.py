"""The API server's configuration (`ServerConfig`: one field per `pagedllm serve` server flag, one docstring per
field, from which config/engine.py generates the flags)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field
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
    enable_log_requests: bool = False
    """Log each request as it arrives (vLLM's request logging): its id and sampling parameters at INFO, its
    prompt text and token ids (cut to --max-log-len) at DEBUG. Off by default, as in vLLM."""
    disable_log_requests: bool = False
    """Deprecated (vLLM no longer has it; request logging is off unless --enable-log-requests): accepted for old
    launch scripts, and turns request logging off even with --enable-log-requests."""
    enable_log_outputs: bool = False
    """Log each finished request's output (vLLM's): its text and finish reason at INFO, its token ids at DEBUG,
    cut to --max-log-len. Needs --enable-log-requests."""
    max_log_len: int | None = None
    """Most prompt or output characters (or token ids) printed in a log line; None: no limit."""
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
    """Seconds to wait for the engine core to load the model and report ready (default: VLLM_ENGINE_READY_TIMEOUT_S
    where set, as vLLM)."""
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
    reasoning_parser: str | None = None
    """Split the model's reasoning out of its output (vLLM's parser names): `qwen3` or `deepseek_r1`
    (`<think>...</think>`). The reasoning goes to the message's `reasoning` (vLLM 0.32's name) and
    `reasoning_content` (the older name), in responses and stream deltas, and to a reasoning item of
    /v1/responses; tool calls are read from the content after it, and a request's grammar (response_format,
    structured_outputs, tool_choice required or named) constrains only the output after the reasoning ends."""
    max_stored_responses: int = 1024
    """Most responses of /v1/responses kept in memory for `previous_response_id` and GET /v1/responses/{id}
    (`store: true`, OpenAI's default); beyond, the least recently used is dropped, and its id answers 404."""
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
    root_path: str | None = None
    """FastAPI's root_path, for a server behind a path-based routing proxy (the prefix the proxy strips, e.g.
    `/llm`): the OpenAPI document and the docs page point at the prefixed URLs, and routes answer with or
    without the prefix."""
    allowed_origins: list[str] = field(default_factory=list)
    """CORS: the origins a browser may call from, as a JSON list (`'["https://app.example"]'`, `'["*"]'` for any).
    Cross-origin browser access is disabled by default, as in vLLM."""
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    """CORS: the methods allowed in a cross-origin request, as a JSON list."""
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    """CORS: the request headers allowed in a cross-origin request, as a JSON list."""
    allow_credentials: bool = False
    """CORS: allow credentials (cookies, Authorization) in cross-origin requests."""
    ssl_keyfile: str | None = None
    """The file path to the TLS private key (PEM), for --ssl-certfile."""
    ssl_certfile: str | None = None
    """The file path to the TLS certificate chain (PEM; it may hold the key too): the server speaks HTTPS only."""
    ssl_ca_certs: str | None = None
    """The CA certificates file (PEM) that client certificates are verified against (--ssl-cert-reqs)."""
    ssl_cert_reqs: int = int(ssl.CERT_NONE)
    """Whether a client certificate is required, as the stdlib ssl module's values: 0 (CERT_NONE), 1
    (CERT_OPTIONAL: verified when sent), 2 (CERT_REQUIRED: mutual TLS)."""
    enable_ssl_refresh: bool = False
    """Reload the TLS certificate chain when --ssl-certfile or --ssl-keyfile change on disk, and the CA
    certificates when --ssl-ca-certs does (a renewed certificate without a restart); new connections use them."""
    ssl_ciphers: str | None = None
    """The TLS cipher suites (OpenSSL's syntax; TLS 1.2 and below only), e.g.
    'ECDHE-RSA-AES256-GCM-SHA384:ECDHE-RSA-CHACHA20-POLY1305'; default: OpenSSL's."""
    response_role: str = "assistant"
    """The role of chat completion responses when the request has `add_generation_prompt` true (the default);
    otherwise a response takes the role of the request's last message, as in vLLM."""
    return_tokens_as_token_ids: bool = False
    """Write each token of `logprobs` (completions and chat, streamed or not) as `token_id:N` instead of its text,
    so that tokens that are not valid UTF-8 on their own can be told apart. A request's own
    `return_tokens_as_token_ids` overrides it."""
    enable_prompt_tokens_details: bool = False
    """Report `usage.prompt_tokens_details.cached_tokens`: the prompt tokens served from the prefix cache (a
    multiple of the block size). Off: `prompt_tokens_details` is null, as in vLLM."""
    enable_force_include_usage: bool = False
    """Include usage in every streaming response (each chunk and a final usage chunk) even without
    `stream_options.include_usage`, as vLLM does."""
    enable_request_id_headers: bool = False
    """Add an `X-Request-Id` header to every response: the request's own `X-Request-Id` header, else a random
    one."""
    disable_fastapi_docs: bool = False
    """Do not serve the OpenAPI document (/openapi.json), the Swagger page (/docs) or the ReDoc page (/redoc)."""
    disable_uvicorn_access_log: bool = False
    """Do not write uvicorn's access log (one line per HTTP request)."""
    enable_debug_routes: bool = False
    """Serve GET /debug/kv_cache (free and total KV blocks, running and waiting requests) for tests, and vLLM's
    development routes (as VLLM_SERVER_DEV_MODE=1 does): POST /reset_prefix_cache, POST /sleep, POST /wake_up and
    GET /is_sleeping."""
    enable_server_load_tracking: bool = False
    """Count the generation requests this API server is serving (from their arrival to the end of their response)
    and report the count at GET /load as `{"server_load": N}` (without this flag /load answers 0, as vLLM's)."""
    api_server_count: int = 1
    """How many API-server processes serve the port, in front of the same engine core(s) (one per data-parallel
    rank): each one parses, tokenizes, detokenizes and streams its share of the connections, and the engine core
    batches the requests of all of them together. Metrics are summed over them (prometheus_client's multiprocess
    mode, in PROMETHEUS_MULTIPROC_DIR or a temporary folder). vLLM's default is the data-parallel size; here 1."""
    otlp_traces_endpoint: str | None = None
    """Target URL to which OpenTelemetry traces are sent: one span `llm_request` per request (each choice of each
    prompt) with vLLM's `gen_ai.*` attributes, a child of the caller's trace when the request has a `traceparent`
    header. OTLP over gRPC, or HTTP with OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf; exported in the
    background and flushed at shutdown. Needs the `otel` extra (opentelemetry-sdk, opentelemetry-exporter-otlp)."""
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
        if self.enable_log_outputs and not self.enable_log_requests:
            raise ValueError("--enable-log-outputs requires --enable-log-requests.")
        if self.ssl_keyfile is not None and self.ssl_certfile is None:
            raise ValueError("--ssl-keyfile needs --ssl-certfile (the certificate of that key).")
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"--{name.replace('_', '-')} must be a JSON list of strings, got {value!r}.")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser {self.reasoning_parser!r} is not a registered reasoning parser; "
                             f"the registered ones are {', '.join(REASONING_PARSERS)}.")
        check_bounds(self, SERVER_BOUNDS)
        parse_lora_modules(self.lora_modules)

    @property
    def log_requests(self) -> bool:
        """Whether each request is logged (--enable-log-requests, unless the deprecated --disable-log-requests)."""
        return self.enable_log_requests and not self.disable_log_requests

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None

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


REASONING_PARSERS = {
    "qwen3": "qwen3",
    "deepseek_r1": "deepseek_r1",
}
"""The reasoning parsers: each --reasoning-parser value (vLLM's names) and its module under
`pagedllm.entrypoints.openai.reasoning_parsers` (a new parser is a module and a line here)."""


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

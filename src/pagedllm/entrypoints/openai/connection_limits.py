"""Limits on the API server's connections, against slowloris and descriptor exhaustion.

Before these, an idle, partial-header or partial-body connection stayed open forever: 21,000 of them used up
the file descriptors, /health and completions timed out, and asyncio logged a traceback for every failed
accept (111 MB of log in 45 s). Now:
- a request head over --max-header-bytes gets a JSON 431 (uvicorn's own answer is a plain-text 400);
- a connection must deliver its request head within --header-read-timeout of opening (or of its first byte
  after a keep-alive pause: uvicorn's keep-alive timeout closes idle ones), else a 408 and close;
- a request's body must arrive within --body-read-timeout of its head, else the connection closes (the
  handler sees a disconnect);
- past --max-connections open connections, a new connection closes the oldest one that is not inside a request
  (its head not complete yet, or idle between keep-alive requests) and is served: a flood of half-open connections
  costs the flooder its own connections, never a prober's /health. When every connection is inside a request, the
  new one is still read (up to PROBE_CONNECTIONS of them past the cap): /health and /metrics are answered (a load
  balancer must never see a healthy but busy server as dead), any other route gets a JSON 503, and the connection
  closes after its response; past those, a new connection gets a JSON 503 at once and is closed. (Before, the
  cap counted /health like the rest: 4,500 half-open connections made /health answer 503 for 10-14 s.)
- the descriptor soft limit is raised to the hard limit at start, and the cap is kept under it;
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from collections import OrderedDict
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedllm.entrypoints.openai import errors

logger = logging.getLogger(__name__)

RESERVED_FDS = 128
"""Descriptors kept free of client connections (engine sockets, log files, the template process...)."""
REJECT_LINGER_S = 1.0
"""How long a rejected connection stays half-closed, so that the client reads the 503 before the close."""
MAX_LINGERING = RESERVED_FDS // 2
"""Rejected connections that may linger at once; past them a rejected one is closed right after its 503."""
PROBE_CONNECTIONS = RESERVED_FDS // 4
"""Connections past --max-connections that are still read, for /health and /metrics, while every connection
under the cap is inside a request; past them a new connection is refused at once."""
PROBE_PATHS = frozenset({"/health", "/ping", "/metrics"})
"""What a connection past the cap may ask for: cheap, and what load balancers and monitoring poll."""


class HeaderLimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, except that a request head over the limit (h11_max_incomplete_event_size)
    gets a JSON 431 instead of a plain-text 400."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._error_status = HTTPStatus.BAD_REQUEST
        next_event = self.conn.next_event

        def next_event_noting_status():
            try:
                return next_event()
            except h11.RemoteProtocolError as e:
                self._error_status = e.error_status_hint
                raise

        self.conn.next_event = next_event_noting_status

    def send_400_response(self, msg: str) -> None:
        if self._error_status != HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE:
            return super().send_400_response(msg)
        body = json.dumps({"error": {"message": "The request headers are too large.", "type": "invalid_request_error",
                                     "param": None, "code": "headers_too_large"}}).encode()
        headers = [(b"content-type", b"application/json"), (b"connection", b"close")]
        self.transport.write(self.conn.send(h11.Response(status_code=431, headers=headers,
                                                         reason=b"Request Header Fields Too Large")))
        self.transport.write(self.conn.send(h11.Data(data=body)))
        self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()


@dataclass
class ConnectionBook:
    """What the connections of one server share, beyond uvicorn's set of them."""

    idle: OrderedDict[ConnectionLimitedH11Protocol, None] = field(default_factory=OrderedDict)
    """The connections that are not inside a request (head not complete yet, or idle between keep-alive
    requests), oldest first: the ones a new connection past the cap closes."""
    num_closing: int = 0
    """Connections closed to make room and not gone yet (still in uvicorn's set until their connection_lost)."""


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int
    header_read_timeout: float
    body_read_timeout: float
    book: ConnectionBook = field(default_factory=ConnectionBook, compare=False, repr=False)


class ProbesOnly:
    """The ASGI app of a connection past the cap: /health and /metrics go to `app`, anything else gets a JSON 503
    (too_many_connections); every response closes the connection."""

    def __init__(self, app, max_connections: int):
        self.app = app
        self.max_connections = max_connections

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] in PROBE_PATHS:
            await self.app(scope, receive, send)
            return
        error = _too_many_connections(self.max_connections)
        body = json.dumps({"error": error.to_info().model_dump()}).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close"), *((k.lower().encode(), v.encode()) for k, v in error.headers.items())]
        await send({"type": "http.response.start", "status": int(error.status), "headers": headers})
        await send({"type": "http.response.body", "body": body})


def _too_many_connections(max_connections: int) -> errors.APIError:
    return errors.unavailable(f"The server has too many open connections (--max-connections {max_connections}).",
                              "too_many_connections", retry_after_s=1)


class ConnectionLimitedH11Protocol(HeaderLimitedH11Protocol):
    """uvicorn's h11 protocol with the connection cap and the head and body read deadlines of `limits`."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._deadline: asyncio.TimerHandle | None = None
        self._waiting_for: str | None = None  # "head", "body" or None (nothing to wait for: no deadline)
        self._rejected = False
        self._probes_only = False  # admitted past the cap: /health and /metrics only, closed after one response
        self._evicted = False
        self._head_started = False  # bytes of a request head not complete yet

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        limits = self.limits
        over = len(self.connections) - limits.max_connections - limits.book.num_closing
        if over > 0 and not self._evict_oldest_idle():
            if over > PROBE_CONNECTIONS:
                self._reject()
                return
            self._probes_only = True
            self.app = ProbesOnly(self.app, limits.max_connections)
        limits.book.idle[self] = None
        self._wait_for("head")

    def data_received(self, data: bytes) -> None:
        if self._rejected:
            return  # the 503 is on its way; what the client sends is dropped
        if self._waiting_for is None and self.conn.their_state is h11.IDLE:
            self._wait_for("head")  # the first bytes of the next request on a kept-alive connection
        self._head_started = True
        super().data_received(data)
        if self._in_request():
            self.limits.book.idle.pop(self, None)
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self._waiting_for != "body":
                self._wait_for("body")
        elif state is not h11.IDLE:  # DONE (the whole request is in), MUST_CLOSE, CLOSED, ERROR
            self._wait_for(None)

    def on_response_complete(self) -> None:
        if self._probes_only:  # a connection past the cap serves one response
            self._wait_for(None)
            self.transport.close()
            super().on_response_complete()
            return
        super().on_response_complete()  # may start a pipelined request
        if self.conn.their_state is h11.SEND_BODY:
            if self._waiting_for != "body":
                self._wait_for("body")
        else:
            self._wait_for(None)  # idle until the next request: uvicorn's keep-alive timeout applies
        if not self._in_request() and not self.transport.is_closing():
            self._head_started = False
            self.limits.book.idle[self] = None  # idle from now: the newest
            self.limits.book.idle.move_to_end(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._wait_for(None)
        self.limits.book.idle.pop(self, None)
        if self._evicted:
            self._evicted = False
            self.limits.book.num_closing -= 1
        super().connection_lost(exc)

    def _in_request(self) -> bool:
        """A request head is complete and its response not yet (or a pipelined one follows)."""
        cycle = self.cycle
        return (cycle is not None and not cycle.response_complete) or self.conn.their_state is not h11.IDLE

    def _evict_oldest_idle(self) -> bool:
        """Close the oldest connection that is not inside a request, to make room for this one; False if every
        connection is inside a request."""
        idle = self.limits.book.idle
        while idle:
            oldest, _ = idle.popitem(last=False)
            if oldest is self or oldest.transport is None or oldest.transport.is_closing():
                continue
            oldest._evict()
            return True
        return False

    def _evict(self) -> None:
        self._wait_for(None)
        self._evicted = True
        self.limits.book.num_closing += 1
        if self._head_started:  # a client that was sending a request learns why it was cut off
            self._write_error(_too_many_connections(self.limits.max_connections))
        self.transport.close()

    def _wait_for(self, what: str | None) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._waiting_for = what
        if what == "head":
            self._deadline = self.loop.call_later(self.limits.header_read_timeout, self._head_timed_out)
        elif what == "body":
            self._deadline = self.loop.call_later(self.limits.body_read_timeout, self.transport.close)

    def _head_timed_out(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self._write_error(errors.APIError(
                HTTPStatus.REQUEST_TIMEOUT, f"The request head did not arrive within "
                f"{self.limits.header_read_timeout:g} s.", "invalid_request_error", code="request_timeout"))
            self.transport.close()

    def _reject(self) -> None:
        self._rejected = True
        self._write_error(_too_many_connections(self.limits.max_connections))
        lingering = len(self.connections) - self.limits.max_connections  # this one included
        if lingering <= MAX_LINGERING and self.transport.can_write_eof():
            self.transport.write_eof()  # half-close: the client reads the 503, then the linger timer closes
            self.loop.call_later(REJECT_LINGER_S, self.transport.close)
        else:
            self.transport.close()

    def _write_error(self, error: errors.APIError) -> None:
        """An error response written raw: no request was parsed, so h11 has no response to send."""
        body = json.dumps({"error": error.to_info().model_dump()}).encode()
        headers = {"content-type": "application/json", "content-length": str(len(body)), "connection": "close",
                   **(error.headers or {})}
        head = f"HTTP/1.1 {int(error.status)} {HTTPStatus(error.status).phrase}\r\n" + "".join(
            f"{name}: {value}\r\n" for name, value in headers.items()) + "\r\n"
        self.transport.write(head.encode() + body)


def raise_fd_limit() -> int:
    """Raise the soft limit on open descriptors to the hard limit, as servers do; returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)
    return soft


def effective_max_connections(max_connections: int, fd_limit: int) -> int:
    """The connection cap, lowered to leave RESERVED_FDS descriptors free under fd_limit."""
    room = max(fd_limit - RESERVED_FDS, 1)
    if max_connections > room:
        logger.warning("--max-connections %d is above what the open-file limit (%d) allows: capping at %d",
                       max_connections, fd_limit, room)
        return room
    return max_connections


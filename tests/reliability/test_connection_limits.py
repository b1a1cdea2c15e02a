"""Slowloris and half-open floods against --max-connections.

- Past the cap, a new connection closes the oldest one that is not inside a request (head not complete, or idle
  keep-alive) and is served: hundreds of half-open connections over a cap of 50 never make /health answer
  anything but 200, and a completion still works (before: every new connection got a 503 past the cap, /health
  included, until the flood's connections timed out).
- When every connection under the cap is inside a request, /health and /metrics still answer 200 and any other
  route gets a JSON 503 too_many_connections.
- Idle, partial-head and partial-body connections are closed at their deadlines (--header-read-timeout,
  --body-read-timeout) and the descriptors come back (before those: 21,000 such connections used up the
  descriptors and /health timed out).
"""

from __future__ import annotations

import json
import socket
import time

import pytest
from reliability_utils import MODEL_NAME, num_fds, wait_for

pytestmark = pytest.mark.slow

PARTIAL_HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\n"
PARTIAL_BODY = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 100\r\n\r\n{\"prompt\"")
FLOOD_CAP = 50
FLOOD_SOCKETS = 400
BUSY_CAP = 6
SLOW_STEP_S = 6  # the busy server's first step: its streams stay inside their requests while the test probes
SLOW_CAP = 100
DEADLINE_S = 2.0


@pytest.fixture(scope="module")
def servers(launcher) -> dict:
    """Every server of the module, launched at once (their start-ups overlap); each test waits for its own."""
    return {
        # the default 10 s head deadline: what keeps /health alive is the eviction, not the deadline
        "flood": launcher("--max-connections", str(FLOOD_CAP), wait_ready=False),
        "busy": launcher("--max-connections", str(BUSY_CAP),
                         env={"PAGEDLLM_FAULT_INJECT": f"sleep_in_forward:after_steps=0,seconds={SLOW_STEP_S}"},
                         wait_ready=False),
        "slow": launcher("--max-connections", str(SLOW_CAP), "--header-read-timeout", str(DEADLINE_S),
                         "--body-read-timeout", str(DEADLINE_S), wait_ready=False),
    }


def _open(port: int, data: bytes) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    if data:
        sock.sendall(data)
    return sock


def _read_until_closed(sock: socket.socket, timeout_s: float) -> bytes | None:
    """Everything the server sends until it closes the connection; None if it is still open at timeout_s."""
    sock.settimeout(timeout_s)
    answer = b""
    try:
        while chunk := sock.recv(65536):
            answer += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return answer


def _status_and_error(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)["error"]


def _health(server) -> int:
    return server.http.get("/health", headers={"Connection": "close"}, timeout=30).status_code


def test_half_open_connections_past_the_cap_never_take_health(servers):
    server = servers["flood"].wait_ready()
    fds_before = num_fds(server.proc.pid)
    kinds = [b"", PARTIAL_HEAD]
    held, statuses = [], []
    for _ in range(FLOOD_SOCKETS // FLOOD_CAP):
        held += [(kinds[i % 2], _open(server.port, kinds[i % 2])) for i in range(FLOOD_CAP)]
        statuses.append(_health(server))
    print(f"FIGURE {FLOOD_SOCKETS} half-open connections over --max-connections {FLOOD_CAP}: /health "
          f"{statuses.count(200)}/{len(statuses)} answered 200")
    assert statuses == [200] * len(statuses), statuses

    response = server.client().completions.create(model=MODEL_NAME, prompt="hello", max_tokens=2)
    assert response.choices[0].finish_reason in ("length", "stop")
    # the oldest were closed to make room: a partial head learns why, an empty connection is just closed
    evicted = [(kind, _read_until_closed(sock, 10.0)) for kind, sock in held[:100]]
    assert all(answer is not None for _, answer in evicted), "an old half-open connection stayed open"
    for kind, answer in evicted:
        if kind:
            status, error = _status_and_error(answer)
            assert status == 503 and error["code"] == "too_many_connections", answer[:200]
            assert f"--max-connections {FLOOD_CAP}" in error["message"]
        else:
            assert answer == b""
    assert num_fds(server.proc.pid) <= fds_before + FLOOD_CAP + 10, (num_fds(server.proc.pid), fds_before)
    for _, sock in held:
        sock.close()
    assert wait_for(lambda: num_fds(server.proc.pid) <= fds_before + 5, 10), (num_fds(server.proc.pid), fds_before)


def test_probes_answer_while_every_connection_is_inside_a_request(servers):
    server = servers["busy"].wait_ready()
    body = json.dumps({"model": MODEL_NAME, "prompt": "hello", "max_tokens": 8, "stream": True}).encode()
    request = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    # the first engine step sleeps SLOW_STEP_S: every one of these streams is inside its request meanwhile
    busy = [_open(server.port, request) for _ in range(BUSY_CAP)]
    time.sleep(0.2)  # so that the server has read their heads (a newcomer would otherwise evict one)
    health = [_health(server) for _ in range(3)]
    metrics = server.http.get("/metrics", headers={"Connection": "close"}, timeout=30)
    completion = server.http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2},
                                  headers={"Connection": "close"}, timeout=30)
    assert health == [200, 200, 200]
    assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text
    assert completion.status_code == 503, completion.text[:300]
    error = completion.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == "too_many_connections"
    assert completion.headers["retry-after"] == "1"
    for sock in busy:  # the streams were served, not cut off
        sock.settimeout(SLOW_STEP_S + 30)
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
        sock.close()


def test_slow_connections_are_closed_at_their_deadlines(servers):
    server = servers["slow"].wait_ready()
    fds_before = num_fds(server.proc.pid)
    kinds = [b"", PARTIAL_HEAD, PARTIAL_BODY]
    opened_at = time.monotonic()
    held = [(kinds[i % 3], _open(server.port, kinds[i % 3])) for i in range(SLOW_CAP - 10)]
    assert _health(server) == 200  # 90 slow connections do not stop /health

    closed = {kind: [] for kind in kinds}
    for kind, sock in held:
        closed[kind].append(_read_until_closed(sock, max(0.1, opened_at + DEADLINE_S + 30.0 - time.monotonic())))
        sock.close()
    print(f"FIGURE {len(held)} slow connections closed {time.monotonic() - opened_at:.1f} s after opening "
          f"(deadline {DEADLINE_S:g} s)")
    assert all(answer is not None for answers in closed.values() for answer in answers), "a slow connection stayed open"
    for kind in (b"", PARTIAL_HEAD):  # no request head in time: a 408
        assert all(_status_and_error(answer)[1]["code"] == "request_timeout" for answer in closed[kind])
    assert all(answer == b"" for answer in closed[PARTIAL_BODY])  # the body never came: closed

    assert wait_for(lambda: _health(server) == 200, 5)
    assert wait_for(lambda: num_fds(server.proc.pid) <= fds_before + 5, 5), (num_fds(server.proc.pid), fds_before)
    response = server.client().completions.create(model=MODEL_NAME, prompt="hello", max_tokens=2)
    assert response.choices[0].finish_reason in ("length", "stop")

"""A normal shutdown of a server with worker processes (--tensor-parallel-size 2 --pipeline-parallel-size 2, mp):
Ctrl-C (SIGINT to the terminal's foreground process group) and `kill %1` / `timeout` (SIGTERM to the job's group)
under open streams, with the request chat-template child running. Each exits 0, ends the streams cleanly
(a finish reason and [DONE]), logs nothing alarming and leaves no process behind (issue 32 item 14: before, a
group SIGTERM killed the engine core under the drain, "engine core process exited unexpectedly", exit 1; Ctrl-C
under open streams logged uvicorn's cancel tracebacks and errors for aborts that could not be sent)."""

from __future__ import annotations

import os
import signal
import threading

import pytest
from reliability_utils import MODEL_NAME, alarming_lines, descendants, pid_alive, stream_to_its_end, wait_for

pytestmark = pytest.mark.slow

TP2_PP2 = ("--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--trust-request-chat-template")
TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"


@pytest.fixture(scope="module")
def servers(launcher) -> dict:
    """One server per signal, launched at once (their start-ups overlap), each in a process group of its own."""
    return {sig: launcher(*TP2_PP2, name=sig.name, wait_ready=False, new_session=True)
            for sig in (signal.SIGINT, signal.SIGTERM)}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "group-sigterm"])
def test_a_signal_to_the_group_shuts_down_cleanly_with_no_process_left(servers, sig):
    server = servers[sig].wait_ready()
    chat = server.http.post("/v1/chat/completions", json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
        "chat_template": TEMPLATE})  # starts the chat-template child process
    assert chat.status_code == 200, chat.text
    results: list = []
    lock = threading.Lock()
    threads = [threading.Thread(target=stream_to_its_end, args=(server, results, lock)) for _ in range(2)]
    for t in threads:
        t.start()
    assert wait_for(lambda: server.kv()["num_running_reqs"] == 2, 60.0), server.kv()
    processes = [server.proc.pid, *descendants(server.proc.pid)]
    assert len(processes) >= 7, processes  # the API server, its engine core, 4 workers, the template child
    os.killpg(server.proc.pid, sig)
    assert server.proc.wait(timeout=120) == 0, server.log()[-3000:]  # a hang guard
    for t in threads:
        t.join(timeout=60)
    assert len(results) == 2, results
    for outcome in results:  # Ctrl-C aborts them, SIGTERM's drain lets them finish: either way a clean end
        assert not isinstance(outcome, Exception), results
        reasons, done = outcome
        assert done and len(reasons) == 1 and reasons[0] in ("abort", "length"), results
    assert wait_for(lambda: not [pid for pid in processes if pid_alive(pid)], 30.0), \
        [pid for pid in processes if pid_alive(pid)]
    assert alarming_lines(server.log()) == [], server.log()[-3000:]

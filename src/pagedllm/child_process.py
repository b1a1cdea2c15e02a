"""What pagedllm's processes share about their own lifetime: the SIGTERM handler, removing IPC socket files, and
the exit that skips the interpreter's teardown.

The engine-core and worker processes are fresh interpreters started by a parent that waits for them (never
forked); `pagedllm serve` is the API server that waits for its engine cores. By the time their `main()` returns,
they have closed their sockets, removed their socket files and stopped their own children; what is left is the
interpreter's teardown of torch's and transformers' modules: 0.5 s on a quiet machine, 2-5 s on a loaded one
(measured at load 13-19: `import torch` then exit 2.5 s, 0.09 s with os._exit; the API server's modules 5.5 s).
Every shutdown and test teardown waited for it, and the engine core's ran past the API server's 5 s wait, which
then killed it."""

from __future__ import annotations

import logging
import os
import signal
import sys


def raise_system_exit(signum, frame) -> None:
    """SIGTERM handler: unwind the main thread through its `finally` clean-ups."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # once: a second SIGTERM must not interrupt the cleanup
    raise SystemExit(0)


def remove_ipc_files(*addrs: str) -> None:
    """Remove the files of `ipc://` endpoints and their directory once empty (others are left alone)."""
    for addr in addrs:
        if addr.startswith("ipc://"):
            path = addr[len("ipc://"):]
            for remove in (os.unlink, lambda p: os.rmdir(os.path.dirname(p))):
                try:
                    remove(path)
                except OSError:
                    pass


def exit_after_cleanup(code: int) -> None:
    """Flush the logs and standard streams, then end the process without the interpreter's teardown."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)

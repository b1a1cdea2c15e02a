"""--enable-ssl-refresh (vLLM's SSLCertRefresher): when the certificate, key or CA files change on disk (a renewed
certificate, a rotated CA), the server's TLS context loads them again; new connections use the new ones, open ones
keep theirs. vLLM watches the files with watchfiles; this polls their modification times and sizes once a second
(no extra dependency)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 1.0


def _signature(paths: list[str]) -> tuple:
    """What changes when a file is rewritten or replaced (a renamed-in file, as cert managers write them)."""
    result = []
    for path in paths:
        try:
            st = os.stat(path)
            result.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            result.append(None)
    return tuple(result)


class SSLCertRefresher:
    """Reloads `context`'s certificate chain when key_path or cert_path change, and its CA certificates when
    ca_path changes, until stop()."""

    def __init__(self, context: ssl.SSLContext, key_path: str | None, cert_path: str,
                 ca_path: str | None = None, interval_s: float = POLL_INTERVAL_S):
        self.context = context
        self.key_path, self.cert_path, self.ca_path = key_path, cert_path, ca_path
        self.interval_s = interval_s
        self._task = asyncio.ensure_future(self._watch())

    def _chain_files(self) -> list[str]:
        return [p for p in (self.key_path, self.cert_path) if p is not None]

    async def _watch(self) -> None:
        chain = _signature(self._chain_files())
        ca = _signature([self.ca_path]) if self.ca_path else None
        logger.info("SSLCertRefresher monitors files: %s", [*self._chain_files(), *filter(None, [self.ca_path])])
        while True:
            await asyncio.sleep(self.interval_s)
            now = _signature(self._chain_files())
            if now != chain:
                chain = now
                self._reload("SSL certificate chain", lambda: self.context.load_cert_chain(self.cert_path,
                                                                                            self.key_path))
            if self.ca_path:
                now_ca = _signature([self.ca_path])
                if now_ca != ca:
                    ca = now_ca
                    self._reload("SSL CA certificates", lambda: self.context.load_verify_locations(self.ca_path))

    @staticmethod
    def _reload(what: str, load) -> None:
        logger.info("Reloading %s", what)
        try:
            load()
        except (OSError, ssl.SSLError, ValueError) as e:  # a half-written file: the next change loads it
            logger.error("SSLCertRefresher failed to reload the %s: %s", what, e)

    async def stop(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

"""SharedRegion: one file in /dev/shm that every process of every data-parallel replica on the host maps.

Lifetime, without a leak when the last user goes (crashed users included):
- each process opens the file once (O_CREAT) and holds a shared flock on it for as long as it uses it; it checks
  that the file it locked is still the one at the path (a last user may have unlinked it meanwhile) and retries;
- the first user to find the file empty sizes it (posix_fallocate: a tmpfs too small fails here, cleanly, not
  with a SIGBUS later) and writes the header; an attacher that gives no geometry (the scheduler side) never
  creates it;
- detaching drops the shared flock and tries an exclusive one without blocking: whoever gets it is the last
  user and unlinks the file (and calls `on_last`, which removes the disk tier's files). The kernel drops the
  flock of a process that dies, so a crashed replica does not keep the region alive for ever.

Mutual exclusion over the index: a POSIX record lock on byte 0 of the same file (independent of the flock on
Linux) between processes, and a threading lock between the threads of one process (record locks are per
process). Every process keeps one attachment per path (a registry with a use count), so the scheduler side and
an in-process worker share one file descriptor: closing a second descriptor would drop the process's record locks.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import mmap
import os
import threading
from collections.abc import Callable, Iterator

_registry: dict[str, SharedRegion] = {}
_registry_lock = threading.Lock()


class RegionGeometryError(ValueError):
    pass


class SharedRegion:
    """A mapped shared file. Use `attach` (never the constructor) and `detach` once per `attach`."""

    def __init__(self, path: str, fd: int, size: int):
        self.path = path
        self.fd = fd
        self.pid = os.getpid()
        self.map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.size = size
        self.users = 0
        self.thread_lock = threading.RLock()
        self._depth = 0
        self.on_last: list[Callable[[], None]] = []
        """Called by the process that unlinks the region (the last user), after the unlink."""

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """The index lock: held by one thread of one process at a time (re-entrant within a thread)."""
        with self.thread_lock:
            if self._depth == 0:
                fcntl.lockf(self.fd, fcntl.LOCK_EX, 1, 0)
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    fcntl.lockf(self.fd, fcntl.LOCK_UN, 1, 0)

    @classmethod
    def attach(cls, path: str, size: int | None, init: Callable[[memoryview], None],
               check: Callable[[memoryview], bool]) -> SharedRegion | None:
        """This process's attachment to the region at `path`, created with `size` bytes and `init` (which writes
        the header) if the file is new. `size` None: attach only (None when there is no region yet). `check`
        says whether an existing region's header is usable (else RegionGeometryError)."""
        with _registry_lock:
            region = _registry.get(path)
            if region is not None and region.pid != os.getpid():  # inherited across fork: not ours
                region = None
            if region is None:
                region = cls._open(path, size, init, check)
                if region is None:
                    return None
                _registry[path] = region
            elif not check(memoryview(region.map)):
                raise RegionGeometryError(_geometry_message(path))
            region.users += 1
            return region

    @classmethod
    def _open(cls, path: str, size: int | None, init, check) -> SharedRegion | None:
        while True:
            try:
                fd = os.open(path, os.O_RDWR | (os.O_CREAT if size is not None else 0), 0o600)
            except FileNotFoundError:
                return None
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                same = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the last user unlinked it between our open and our lock: open the new one
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX, 1, 0)
            try:
                current = os.fstat(fd).st_size
                if current == 0:
                    if size is None:
                        raise _NotCreated
                    try:
                        os.posix_fallocate(fd, 0, size)
                    except OSError as e:
                        os.ftruncate(fd, 0)
                        raise OSError(e.errno, f"cannot reserve {size} bytes for the KV offload tier in "
                                               f"{os.path.dirname(path)} ({e.strerror}); lower cpu_bytes_to_use "
                                               f"(--kv-offloading-size) or enlarge it") from None
                    region = cls(path, fd, size)
                    init(memoryview(region.map))
                else:
                    region = cls(path, fd, current)
                    if not check(memoryview(region.map)):
                        region._close_map()
                        raise RegionGeometryError(_geometry_message(path))
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN, 1, 0)
        except _NotCreated:
            _release(fd, path, unlink_if_last=True)
            return None
        except BaseException:
            _release(fd, path, unlink_if_last=True)
            raise
        return region

    def detach(self) -> None:
        """One `attach` less; the process's last detach unmaps, and the host's last user unlinks the file."""
        with _registry_lock:
            self.users -= 1
            if self.users > 0:
                return
            if _registry.get(self.path) is self:
                del _registry[self.path]
        self._close_map()
        if _release(self.fd, self.path, unlink_if_last=True):
            for callback in self.on_last:
                with contextlib.suppress(Exception):
                    callback()

    def _close_map(self) -> None:
        with contextlib.suppress(BufferError):  # views still exported: the mapping goes with them
            self.map.close()


class _NotCreated(Exception):
    pass


def _geometry_message(path: str) -> str:
    return (f"the KV offload region {path} exists with another layout (another model, block size, tensor-parallel "
            f"size or tier size); give this server its own kv_connector_extra_config shm_name")


def reap_orphans(directory: str, prefix: str, name: str | None = None) -> list[str]:
    """Unlink the regions named `prefix*` (and `name`) in `directory` that no live process uses (left by a process
    that was killed before it could detach). Returns their paths."""
    reaped = []
    with contextlib.suppress(OSError):
        names = [n for n in os.listdir(directory) if n.startswith(prefix) or n == name]
        for name in names:
            path = os.path.join(directory, name)
            if path in _registry:
                continue
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            if _release(fd, path, unlink_if_last=True):
                reaped.append(path)
    return reaped


@atexit.register
def _detach_all() -> None:
    """At interpreter exit, every attachment this process still holds goes (an engine never shut down would
    otherwise leave its region in /dev/shm)."""
    for region in list(_registry.values()):
        if region.pid == os.getpid():
            region.users = 1
            with contextlib.suppress(Exception):
                region.detach()


def _release(fd: int, path: str, unlink_if_last: bool) -> bool:
    """Drop this descriptor's shared lock; if no other user holds one, unlink `path` (if it is still this file).
    Returns whether it unlinked."""
    unlinked = False
    try:
        fcntl.flock(fd, fcntl.LOCK_UN)
        if unlink_if_last:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pass
            else:
                with contextlib.suppress(FileNotFoundError):
                    if os.stat(path).st_ino == os.fstat(fd).st_ino:
                        os.unlink(path)
                        unlinked = True
    finally:
        os.close(fd)
    return unlinked

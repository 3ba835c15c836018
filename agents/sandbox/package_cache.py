"""The unpacked-package cache: ``root/<sha256 digest>/`` holds one verified, extracted package.

DB-free (the agent uses it; the in-process executor too).  A hit makes no request,
and mostly no system call either: the cache remembers the packages it has seen and
touches a package's directory (its mtime, the LRU clock other processes sharing the root
read) at most every ``TOUCH_INTERVAL_S``.  A miss fetches the bytes, checks them against the
digest, extracts into a temporary directory beside the cache and renames it
into place: the rename is atomic, so a reader never sees a half-written
package.  A per-digest lock (a thread lock plus an ``flock`` on
``root/.locks/<digest>``) makes concurrent callers, in one process or several
sharing a root, fetch each package once.

When the unpacked packages exceed ``max_bytes`` the least recently used ones
are removed, never the one just returned nor one pinned with :meth:`use` or :meth:`pin` —
by this process or by any other sharing the root: a pin holds a shared ``flock`` on
``root/.locks/<digest>.pin``, and eviction removes a package only under an exclusive one
(agents started by the process actuator, or by hand with one ``CLOACINA_HOME``, share a
root).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import hashlib
import inspect
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

from agents.sandbox.archive import safe_extract

DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
TMP_PREFIX = ".tmp-"
# A temporary extraction dir this old was left by a process that died mid-extract.
STALE_TMP_AGE_S = 3600.0
# How stale a package's mtime may get while this process keeps using it.  Every task of an
# agent looks its package up: a touch per task was a system call per task, where one a
# second does.  Eviction in this process orders by its own record of use, exact to the
# call; another process sharing the root (agents with one CLOACINA_HOME) sees this one's
# use at most this late.  A package such a process deleted from under an unpinned caller is
# noticed at the next touch; pinned ones (every task's) it cannot delete.
TOUCH_INTERVAL_S = 1.0


class PackageCacheError(Exception):
    """A package could not be put in the cache (the message says why)."""


class DigestMismatch(PackageCacheError):
    """The fetched bytes are not the package the digest names; nothing was kept."""


def _tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


class PackageCache:
    def __init__(self, root: Path, max_bytes: int, pin_linger_s: float = 0.0) -> None:
        """``pin_linger_s``: keep a package's pin (its shared ``flock``) this long after its
        last :meth:`unpin`, so that one task after another on the same package does not
        open, lock and close the pin file each time (the agent: its tasks mostly come one
        or a few at a time).  Other processes sharing the root cannot evict the package
        meanwhile; :meth:`release_idle_pins` lets go of the pins kept past it."""
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.pin_linger_s = pin_linger_s
        if not self.root.is_dir():
            self.root.mkdir(parents=True, exist_ok=True)
            # Task children (another user when the parent is root) may enter the root to
            # reach their package but not list it: other packages' digests are not theirs to
            # find.  A root someone else made keeps its mode.
            os.chmod(self.root, 0o711)
        (self.root / ".locks").mkdir(mode=0o700, exist_ok=True)
        self._guard = threading.Lock()
        self._digest_locks: dict[str, threading.Lock] = {}
        self._pins: dict[str, int] = {}
        self._pin_fds: dict[str, int] = {}  # digest -> fd holding the shared pin flock
        # digest -> monotonic time its last pin ended, for pins kept (pin_linger_s).
        self._lingering: dict[str, float] = {}
        self._sizes: dict[str, int] = {}  # digest -> unpacked bytes, learnt lazily
        # digest -> (its directory, monotonic time of our last touch): the hit path.
        self._seen: dict[str, tuple[Path, float]] = {}
        self._last_used: dict[str, float] = {}  # digest -> wall time of our last use
        self._inflight: dict[str, asyncio.Future] = {}  # aget: one fetch per digest per loop
        self.hits = 0
        self.misses = 0
        self._remove_stale_tmp()

    # -- public API ---------------------------------------------------------

    def path_for(self, digest: str) -> Path:
        return self.root / _checked(digest)

    def get(self, digest: str, fetch: Callable[[], bytes]) -> Path:
        """The unpacked package for ``digest``; ``fetch()`` is called only on a miss."""
        hit = self._hit(digest)
        if hit is not None:
            return hit
        path = self.path_for(digest)
        with self._digest_lock(digest):
            if self._hit(digest) is not None:  # another caller filled it while we waited
                return path
            self.misses += 1
            self._fill(digest, path, fetch())
            self._remember(digest, path)
        self.evict(keep=digest)
        return path

    async def aget(
        self, digest: str, fetch: Callable[[], bytes] | Callable[[], Awaitable[bytes]]
    ) -> Path:
        """:meth:`get` for the event loop; ``fetch`` may be a coroutine function.

        Concurrent misses for one digest on this loop share a single fetch.
        """
        hit = self._hit(digest)
        if hit is not None:
            return hit
        if not inspect.iscoroutinefunction(fetch):
            return await asyncio.to_thread(self.get, digest, fetch)
        pending = self._inflight.get(digest)
        if pending is None:
            pending = asyncio.ensure_future(self._afill(digest, fetch))
            self._inflight[digest] = pending
            pending.add_done_callback(lambda _f: self._inflight.pop(digest, None))
        return await asyncio.shield(pending)

    async def _afill(self, digest: str, fetch: Callable[[], Awaitable[bytes]]) -> Path:
        data = await fetch()
        return await asyncio.to_thread(self.store, digest, data)

    def store(self, digest: str, data: bytes) -> Path:
        """Put already-fetched bytes in the cache (verified against ``digest``)."""
        return self.get(digest, lambda: data)

    @contextlib.contextmanager
    def use(self, digest: str, fetch: Callable[[], bytes]) -> Iterator[Path]:
        """:meth:`get`, pinned against eviction until the block ends."""
        self.pin(digest)
        try:
            yield self.get(digest, fetch)
        finally:
            self.unpin(digest)

    def pin(self, digest: str) -> None:
        """Protect ``digest`` from eviction, by any process sharing the root, until
        :meth:`unpin` (counted).  Call it before :meth:`get`, so that what ``get`` returns
        stays put."""
        if digest not in self._seen:
            _checked(digest)
        with self._guard:
            count = self._pins.get(digest, 0) + 1
            self._pins[digest] = count
            # A kept pin was held all along: nothing can have removed the package since.
            if count == 1 and self._lingering.pop(digest, None) is None:
                self._hold_pin_lock(digest)

    def unpin(self, digest: str) -> None:
        with self._guard:
            left = self._pins.get(digest, 0) - 1
            if left > 0:
                self._pins[digest] = left
                return
            self._pins.pop(digest, None)
            if self.pin_linger_s > 0 and digest in self._pin_fds:
                now = time.monotonic()
                released = self._take_lingering(now)
                self._lingering[digest] = now
            else:
                fd = self._pin_fds.pop(digest, None)
                released = [] if fd is None else [fd]
        for fd in released:
            os.close(fd)  # releases the shared flock

    def release_idle_pins(self, everything: bool = False) -> None:
        """Let go of the pins kept longer than ``pin_linger_s`` after their last use
        (``everything``: of every kept pin).  Pins in use stay."""
        with self._guard:
            released = self._take_lingering(time.monotonic(), everything)
        for fd in released:
            os.close(fd)

    def _take_lingering(self, now: float, everything: bool = False) -> list[int]:
        """The fds of kept pins due for release, forgotten (under ``_guard``)."""
        due = [
            digest
            for digest, since in self._lingering.items()
            if everything or now - since >= self.pin_linger_s
        ]
        for digest in due:
            del self._lingering[digest]
        return [self._pin_fds.pop(digest) for digest in due]

    def _hold_pin_lock(self, digest: str) -> None:
        # Blocks only while another process renames this package away (see evict).  Once
        # held, the package cannot go; but it may have gone just before, and the hit path
        # trusts what it saw for TOUCH_INTERVAL_S: forget it, so the next get() checks.
        fd = os.open(self.root / ".locks" / f"{digest}.pin", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
        except BaseException:
            os.close(fd)
            raise
        self._pin_fds[digest] = fd
        self._seen.pop(digest, None)

    def entries(self) -> list[str]:
        """Digests currently unpacked in the cache."""
        return sorted(p.name for p in self.root.iterdir() if DIGEST_RE.match(p.name) and p.is_dir())

    def total_bytes(self) -> int:
        return sum(self._size(d) for d in self.entries())

    def evict(self, keep: str | None = None) -> list[str]:
        """Remove least recently used packages until the cache fits ``max_bytes``."""
        removed: list[str] = []
        self.release_idle_pins(everything=True)  # our own kept pins must not block us
        with self._file_lock("evict"):
            ages = []
            for digest in self.entries():
                with contextlib.suppress(FileNotFoundError):
                    mtime = os.stat(self.root / digest).st_mtime
                    # Our own uses are exact; the mtime may lag them by TOUCH_INTERVAL_S.
                    ages.append((max(mtime, self._last_used.get(digest, 0.0)), digest))
            total = sum(self._size(d) for _, d in ages)
            for _mtime, digest in sorted(ages):
                if total <= self.max_bytes:
                    break
                with self._guard:
                    pinned = digest in self._pins
                if digest == keep or pinned:
                    continue
                # Skip a package another caller is filling or reading under its lock right now.
                # (Not one pinned by another process, nor one being filled right now.)
                with self._try_digest_lock(digest) as locked:
                    if not locked:
                        continue
                    size = self._size(digest)
                    taken, doomed = self._take_unpinned(digest)
                    if not taken:
                        continue
                    self._sizes.pop(digest, None)
                    total -= size
                    removed.append(digest)
                if doomed is not None:
                    shutil.rmtree(doomed, ignore_errors=True)
        return removed

    def _take_unpinned(self, digest: str) -> tuple[bool, Path | None]:
        """Take ``digest`` out of the cache unless some process has it pinned: whether it
        was taken, and where its directory was renamed to (None: it was gone already)."""
        with self._file_lock(f"{digest}.pin", blocking=False) as free:
            if not free:
                return False, None
            self._forget(digest)
            return True, self._set_aside(self.root / digest)

    # -- internals ------------------------------------------------------------

    def _hit(self, digest: str) -> Path | None:
        """The package's directory if it is unpacked (None: a miss)."""
        seen = self._seen.get(digest)
        now = time.monotonic()
        if seen is not None and now - seen[1] < TOUCH_INTERVAL_S:
            self._last_used[digest] = time.time()
            self.hits += 1
            return seen[0]
        path = self.path_for(digest)
        try:
            os.utime(path)  # mtime is the LRU clock other processes read
        except FileNotFoundError:
            self._forget(digest)
            return None
        self._remember(digest, path, now)
        self.hits += 1
        return path

    def _remember(self, digest: str, path: Path, touched: float | None = None) -> None:
        self._seen[digest] = (path, time.monotonic() if touched is None else touched)
        self._last_used[digest] = time.time()

    def _forget(self, digest: str) -> None:
        self._seen.pop(digest, None)
        self._last_used.pop(digest, None)

    def _fill(self, digest: str, path: Path, data: bytes) -> None:
        if not isinstance(data, bytes | bytearray | memoryview):
            raise PackageCacheError(
                f"fetching package {digest} gave {type(data).__name__}, not bytes"
            )
        actual = hashlib.sha256(data).hexdigest()
        if actual != digest:
            raise DigestMismatch(
                f"package bytes do not match their digest: expected sha256 {digest}, got {actual}"
            )
        tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{digest[:12]}-", dir=self.root))
        try:
            safe_extract(data, tmp)
            os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; children may run as another user
            os.rename(tmp, path)
        except OSError as exc:
            self._discard(tmp)
            if path.is_dir():  # someone outside our locks won the race: theirs is as good
                return
            raise PackageCacheError(f"could not unpack package {digest}: {exc}") from exc
        except BaseException:
            self._discard(tmp)
            raise
        self._sizes[digest] = _tree_bytes(path)

    def _size(self, digest: str) -> int:
        if digest not in self._sizes:
            self._sizes[digest] = _tree_bytes(self.root / digest)
        return self._sizes[digest]

    def _discard(self, path: Path) -> None:
        doomed = self._set_aside(path)
        if doomed is not None:
            shutil.rmtree(doomed, ignore_errors=True)

    def _set_aside(self, path: Path) -> Path | None:
        # Rename first so a concurrent reader never sees a half-deleted package.
        doomed = path.with_name(f"{TMP_PREFIX}gone-{path.name}-{os.getpid()}-{time.monotonic_ns()}")
        try:
            os.rename(path, doomed)
        except FileNotFoundError:
            return None
        return doomed

    def _remove_stale_tmp(self) -> None:
        now = time.time()
        for entry in self.root.glob(f"{TMP_PREFIX}*"):
            with contextlib.suppress(OSError):
                if now - entry.stat().st_mtime > STALE_TMP_AGE_S:
                    shutil.rmtree(entry, ignore_errors=True)

    def _thread_lock(self, digest: str) -> threading.Lock:
        with self._guard:
            return self._digest_locks.setdefault(digest, threading.Lock())

    @contextlib.contextmanager
    def _digest_lock(self, digest: str) -> Iterator[None]:
        with self._thread_lock(digest), self._file_lock(digest):
            yield

    @contextlib.contextmanager
    def _try_digest_lock(self, digest: str) -> Iterator[bool]:
        lock = self._thread_lock(digest)
        if not lock.acquire(blocking=False):
            yield False
            return
        try:
            with self._file_lock(digest, blocking=False) as locked:
                yield locked
        finally:
            lock.release()

    @contextlib.contextmanager
    def _file_lock(self, name: str, blocking: bool = True) -> Iterator[bool]:
        fd = os.open(self.root / ".locks" / name, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            yield True
        finally:
            os.close(fd)  # closing the descriptor releases the flock


def _checked(digest: str) -> str:
    # The digest becomes a path component: anything but 64 lower-case hex is refused.
    if not isinstance(digest, str) or not DIGEST_RE.match(digest):
        raise PackageCacheError(f"not a sha256 hex digest: {digest!r}")
    return digest

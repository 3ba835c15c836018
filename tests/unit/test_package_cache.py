"""The unpacked-package cache: hits make no request, bytes are verified, LRU eviction, locking.

Here: the unit tests (no database, socket or process); the rest are in tests/integration/test_package_cache.py.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from agents.sandbox.archive import ArchiveError
from agents.sandbox.package_cache import DigestMismatch, PackageCache, PackageCacheError
from tests.support.factories import build_tar_gz, sha256
from tests.support.loop import run_async


def archive(tag: str, size: int = 100) -> tuple[str, bytes]:
    data = build_tar_gz(
        {"cloacina.toml": f"# {tag}\n", "workflow/blob.txt": (tag * size)[:size].encode()}
    )
    return sha256(data), data


class Fetcher:
    """A fetch callable that counts its calls (and can be slow, to widen races)."""

    def __init__(self, data: bytes, delay_s: float = 0.0) -> None:
        self.data, self.delay_s, self.calls = data, delay_s, 0
        self._lock = threading.Lock()

    def __call__(self) -> bytes:
        with self._lock:
            self.calls += 1
        time.sleep(self.delay_s)
        return self.data


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name != ".locks")


def test_a_miss_fetches_verifies_and_unpacks(tmp_path):
    cache = PackageCache(tmp_path, max_bytes=10**6)
    digest, data = archive("a")
    fetch = Fetcher(data)
    path = cache.get(digest, fetch)
    assert path == tmp_path / digest
    assert (path / "workflow" / "blob.txt").read_bytes() == b"a" * 100
    assert fetch.calls == 1


def test_a_hit_makes_no_request(tmp_path):
    cache = PackageCache(tmp_path, max_bytes=10**6)
    digest, data = archive("a")
    cache.get(digest, Fetcher(data))

    def must_not_fetch() -> bytes:
        raise AssertionError("a cache hit fetched")

    assert cache.get(digest, must_not_fetch) == tmp_path / digest
    # A second cache object on the same root (another process, a restart) hits too.
    assert PackageCache(tmp_path, 10**6).get(digest, must_not_fetch) == tmp_path / digest


def test_bytes_that_do_not_match_the_digest_are_refused_and_nothing_is_kept(tmp_path):
    cache = PackageCache(tmp_path, max_bytes=10**6)
    digest, _ = archive("a")
    _, other = archive("b")
    with pytest.raises(DigestMismatch, match=f"expected sha256 {digest}, got {sha256(other)}"):
        cache.get(digest, Fetcher(other))
    assert leftovers(tmp_path) == []


def test_an_unsafe_archive_is_refused_and_nothing_is_kept(tmp_path):
    cache = PackageCache(tmp_path, max_bytes=10**6)
    data = build_tar_gz({"../escape.py": "x = 1\n"})
    with pytest.raises(ArchiveError, match="'..'"):
        cache.get(sha256(data), Fetcher(data))
    assert leftovers(tmp_path) == []
    assert not (tmp_path.parent / "escape.py").exists()


@pytest.mark.parametrize("digest", ["../../etc", "ABC", "a" * 63, "g" * 64, ""])
def test_a_digest_that_is_not_sha256_hex_is_refused(tmp_path, digest):
    cache = PackageCache(tmp_path, max_bytes=10**6)
    with pytest.raises(PackageCacheError, match="not a sha256 hex digest"):
        cache.get(digest, Fetcher(b""))


def test_least_recently_used_packages_are_evicted_first(tmp_path):
    # Each package unpacks to ~1 KB; room for two.
    cache = PackageCache(tmp_path, max_bytes=2300)
    (a, da), (b, db), (c, dc) = archive("a", 1000), archive("b", 1000), archive("c", 1000)
    cache.get(a, Fetcher(da))
    time.sleep(0.02)
    cache.get(b, Fetcher(db))
    time.sleep(0.02)
    cache.get(a, Fetcher(da))  # a hit: a is now more recent than b
    time.sleep(0.02)
    cache.get(c, Fetcher(dc))
    assert cache.entries() == sorted([a, c])
    assert cache.total_bytes() <= 2300


def test_the_package_just_returned_is_never_evicted(tmp_path):
    cache = PackageCache(tmp_path, max_bytes=10)  # smaller than any package
    (a, da), (b, db) = archive("a", 1000), archive("b", 1000)
    cache.get(a, Fetcher(da))
    path = cache.get(b, Fetcher(db))
    assert cache.entries() == [b]
    assert (path / "workflow" / "blob.txt").exists()


def test_a_pinned_package_is_not_evicted(tmp_path):
    cache = PackageCache(tmp_path, max_bytes=1500)
    (a, da), (b, db) = archive("a", 1000), archive("b", 1000)
    with cache.use(a, Fetcher(da)) as path:
        cache.get(b, Fetcher(db))
        assert (path / "workflow" / "blob.txt").exists()
        assert cache.entries() == sorted([a, b])
    assert cache.evict() == [a]  # once unpinned, the older one goes


def test_concurrent_threads_fetch_a_package_once(tmp_path):
    cache = PackageCache(tmp_path, max_bytes=10**6)
    digest, data = archive("a")
    fetch = Fetcher(data, delay_s=0.1)
    paths = []
    threads = [
        threading.Thread(target=lambda: paths.append(cache.get(digest, fetch))) for _ in range(8)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert fetch.calls == 1
    assert paths == [tmp_path / digest] * 8
    assert leftovers(tmp_path) == [digest]


def test_concurrent_async_callers_share_one_fetch(tmp_path):
    cache = PackageCache(tmp_path, max_bytes=10**6)
    digest, data = archive("a")
    calls = 0

    async def fetch() -> bytes:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.05)
        return data

    async def scenario():
        return await asyncio.gather(*[cache.aget(digest, fetch) for _ in range(6)])

    assert run_async(scenario()) == [tmp_path / digest] * 6
    assert calls == 1


def test_aget_accepts_a_plain_fetch_function(tmp_path):
    cache = PackageCache(tmp_path, max_bytes=10**6)
    digest, data = archive("a")
    fetch = Fetcher(data)
    assert run_async(cache.aget(digest, fetch)) == tmp_path / digest
    assert run_async(cache.aget(digest, fetch)) == tmp_path / digest
    assert fetch.calls == 1


def test_stale_temporary_directories_are_cleaned_at_start(tmp_path):
    stale = tmp_path / ".tmp-deadbeef-x"
    stale.mkdir()
    old = time.time() - 7200
    os.utime(stale, (old, old))
    fresh = tmp_path / ".tmp-cafe-y"
    fresh.mkdir()  # may belong to a live process: kept
    PackageCache(tmp_path, 10**6)
    assert not stale.exists() and fresh.exists()


def test_a_fetch_that_returns_something_else_than_bytes_is_refused(tmp_path):
    cache = PackageCache(tmp_path, max_bytes=10**6)
    digest, _ = archive("a")
    with pytest.raises(PackageCacheError, match="gave NoneType, not bytes"):
        cache.get(digest, lambda: None)
    assert leftovers(tmp_path) == []


def test_a_hit_within_the_touch_interval_makes_no_system_call(tmp_path, monkeypatch):
    from agents.sandbox import package_cache  # local: the module whose os calls are patched

    monkeypatch.setattr(package_cache, "TOUCH_INTERVAL_S", 3600.0)  # however slow this box
    cache = PackageCache(tmp_path, max_bytes=10**6)
    digest, data = archive("a")
    cache.get(digest, Fetcher(data))
    assert cache.get(digest, Fetcher(data)) == tmp_path / digest

    def no_syscall(*args, **kwargs):
        raise AssertionError("a hit touched the filesystem")

    monkeypatch.setattr(package_cache.os, "utime", no_syscall)
    monkeypatch.setattr(package_cache.os, "stat", no_syscall)
    for _ in range(3):
        assert cache.get(digest, Fetcher(b"")) == tmp_path / digest
        assert run_async(cache.aget(digest, Fetcher(b""))) == tmp_path / digest
    assert cache.hits == 7 and cache.misses == 1


def test_a_package_deleted_from_under_the_cache_is_noticed_at_the_next_touch(tmp_path, monkeypatch):
    cache = PackageCache(tmp_path, max_bytes=10**6)
    digest, data = archive("a")
    path = cache.get(digest, Fetcher(data))
    shutil.rmtree(path)  # another process sharing the root evicted it
    from agents.sandbox import package_cache  # local: the module whose clock is patched

    monkeypatch.setattr(package_cache, "TOUCH_INTERVAL_S", 0.0)
    fetch = Fetcher(data)
    assert cache.get(digest, fetch) == path
    assert fetch.calls == 1 and (path / "workflow" / "blob.txt").exists()


# -- pins kept after their last use (the agent: pin_linger_s) ---------------------------


def test_a_kept_pin_is_taken_again_without_the_lock_file_and_still_holds_off_evictions(
    tmp_path, monkeypatch
):
    from agents.sandbox import package_cache  # local: the module whose os calls are patched

    cache = PackageCache(tmp_path, max_bytes=1500, pin_linger_s=3600.0)
    (a, da), (b, db) = archive("a", 1000), archive("b", 1000)
    with cache.use(a, Fetcher(da)):
        pass

    def no_open(*args, **kwargs):
        raise AssertionError("the pin file was opened again")

    with monkeypatch.context() as patched:
        patched.setattr(package_cache.os, "open", no_open)
        for _ in range(3):  # the next tasks on the package: no open, flock or close
            cache.pin(a)
            cache.unpin(a)
    other = PackageCache(tmp_path, max_bytes=1500)  # another process sharing the root
    other.get(b, Fetcher(db))  # over the limit: it would evict a, but a is still pinned
    assert other.entries() == sorted([a, b])
    cache.release_idle_pins()  # not yet due
    assert a not in other.evict()
    assert a in other.entries()


def test_a_kept_pin_is_let_go_once_due_and_never_blocks_its_own_eviction(tmp_path):
    cache = PackageCache(tmp_path, max_bytes=1500, pin_linger_s=3600.0)
    (a, da), (b, db), (c, dc) = archive("a", 1000), archive("b", 1000), archive("c", 1000)
    with cache.use(a, Fetcher(da)):
        pass
    other = PackageCache(tmp_path, max_bytes=1500)
    other.get(b, Fetcher(db))
    cache.pin_linger_s = 0.0  # its time has come (no clock in the test)
    cache.release_idle_pins()
    assert other.evict() == [a]

    with cache.use(b, Fetcher(db)):
        pass
    cache.pin_linger_s = 3600.0
    cache.get(c, Fetcher(dc))  # this cache's own eviction: its kept pin on b is let go
    assert cache.entries() == [c]


def test_a_pin_still_in_use_is_never_let_go(tmp_path):
    cache = PackageCache(tmp_path, max_bytes=1500, pin_linger_s=0.0001)
    (a, da), (b, db) = archive("a", 1000), archive("b", 1000)
    cache.pin(a)
    cache.get(a, Fetcher(da))
    cache.release_idle_pins(everything=True)
    other = PackageCache(tmp_path, max_bytes=1500)
    other.get(b, Fetcher(db))
    assert other.entries() == sorted([a, b])
    cache.unpin(a)

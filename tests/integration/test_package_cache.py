"""The unpacked-package cache: hits make no request, bytes are verified, LRU eviction, locking.

Here: the integration tests (database, in-process ASGI, fakes); the rest are in tests/unit/test_package_cache.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from agents.sandbox.package_cache import PackageCache
from tests.support.factories import build_tar_gz, sha256

REPO = Path(__file__).resolve().parents[2]


def archive(tag: str, size: int = 100) -> tuple[str, bytes]:
    data = build_tar_gz(
        {"cloacina.toml": f"# {tag}\n", "workflow/blob.txt": (tag * size)[:size].encode()}
    )
    return sha256(data), data


def leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name != ".locks")


def test_concurrent_processes_sharing_a_root_fetch_a_package_once(tmp_path):
    digest, data = archive("a")
    (tmp_path / "pkg.tar.gz").write_bytes(data)
    root, log = tmp_path / "cache", tmp_path / "fetches.log"
    script = f"""
import os, sys, time
sys.path.insert(0, {str(REPO)!r})
from pathlib import Path
from agents.sandbox.package_cache import PackageCache
def fetch():
    with open({str(log)!r}, "a") as fh:
        fh.write(str(os.getpid()) + "\\n")
    time.sleep(0.3)
    return Path({str(tmp_path / "pkg.tar.gz")!r}).read_bytes()
while not Path({str(tmp_path / "go")!r}).exists():
    time.sleep(0.005)
print(PackageCache(Path({str(root)!r}), 10**6).get({digest!r}, fetch))
"""
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    time.sleep(0.3)  # let them all reach the start line
    (tmp_path / "go").touch()
    outputs = [p.communicate(timeout=30)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert outputs == [str(root / digest)] * 3
    assert len(log.read_text().split()) == 1
    assert leftovers(root) == [digest]


def test_the_cache_is_usable_from_a_db_less_process(tmp_path):
    # The agent imports this module; it must not pull Django in.
    code = "import sys, agents.sandbox.package_cache; print(json.dumps('django' in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", "import json; " + code], cwd=REPO, capture_output=True, text=True
    )
    assert json.loads(out.stdout) is False


def test_a_package_pinned_by_another_process_is_not_evicted_until_it_unpins(tmp_path):
    """Agents sharing a cache root (the process actuator's, or started by hand with one
    CLOACINA_HOME): one agent's eviction must not delete a package another is running."""
    root = tmp_path / "cache"
    pinned, data = archive("pinned", size=600)
    (tmp_path / "pkg.tar.gz").write_bytes(data)
    script = f"""
import sys, time
sys.path.insert(0, {str(REPO)!r})
from pathlib import Path
from agents.sandbox.package_cache import PackageCache
cache = PackageCache(Path({str(root)!r}), 10**6)
with cache.use({pinned!r}, lambda: Path({str(tmp_path / "pkg.tar.gz")!r}).read_bytes()) as path:
    print(path, flush=True)
    while not Path({str(tmp_path / "release")!r}).exists():
        time.sleep(0.01)
    print(sorted(p.name for p in path.rglob("*")), flush=True)
"""
    other = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == str(root / pinned)
        # This process shares the root with a byte limit the pinned package alone exceeds.
        cache = PackageCache(root, 1)
        newer, newer_data = archive("newer")
        cache.get(newer, lambda: newer_data)  # evicts down to the limit: all it may
        assert sorted(cache.entries()) == sorted([pinned, newer])
        assert cache.evict() == [newer]  # over the limit still: only the unpinned one goes
        assert cache.entries() == [pinned]
    finally:
        (tmp_path / "release").touch()
    out, _ = other.communicate(timeout=30)
    assert other.returncode == 0
    assert "blob.txt" in out  # the pinned package was whole until its user let it go
    assert cache.evict() == [pinned]  # unpinned (by its process's exit too): evictable
    assert cache.entries() == []

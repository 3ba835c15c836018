"""Hostile packages against a real `serve`: each is refused with a clear 4xx naming the
problem, nothing is stored, the server's memory stays bounded and it keeps serving.

The archive cases themselves (``..``, absolute paths, symlinks and hard links out of
the tree, member count, a cycle, …) are the ones tests/integration/test_packages_api.py checks
in-process; here they travel through daphne and Twisted like any upload, together with
bombs by total size (zip and gzip) and manifests whose numbers would overflow.
"""

from __future__ import annotations

import io
import tarfile
import threading
import time
import zipfile

import psutil
import pytest

from artifacts.store.testing import (
    build_archive,
    example_archive,
    manifest_toml,
    package_files,
    parse_bomb,
)
from tests.support.hostile import Served
from tests.support.keys import tenant_keys
from tests.support.packages import BAD_UPLOADS
from tests.support.processes import Processes

pytestmark = pytest.mark.e2e

BOMB_MB = 240  # expanded; the default cap is 200 MB
MEMORY_GROWTH_MAX_MB = 400  # what a refused bomb may cost the server, at most


def zip_bomb() -> bytes:
    out = io.BytesIO()
    zeros = b"\0" * (60 * 1024 * 1024)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        for name, content in package_files().items():
            zf.writestr(name, content)
        for i in range(BOMB_MB // 60):
            zf.writestr(f"vendor/blob{i}.bin", zeros)
    return out.getvalue()


class _Zeros(io.RawIOBase):
    """``size`` zero bytes, read in chunks: a bomb is built without holding it."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        n = min(len(buffer), self.left)
        buffer[:n] = b"\0" * n
        self.left -= n
        return n


def gzip_bomb() -> bytes:
    """One tar member of BOMB_MB zeros, gzipped (~250 KB on the wire)."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w:gz", compresslevel=9) as tar:
        for name, content in package_files().items():
            info = tarfile.TarInfo(name)
            info.size = len(content.encode())
            tar.addfile(info, io.BytesIO(content.encode()))
        info = tarfile.TarInfo("vendor/zeros.bin")
        info.size = BOMB_MB * 1024 * 1024
        tar.addfile(info, io.BufferedReader(_Zeros(info.size)))
    return out.getvalue()


def manifest_with(**task_fields) -> bytes:
    files = package_files()
    files["cloacina.toml"] = manifest_toml([{"id": "a", "function": "demo.steps:a", **task_fields}])
    return build_archive(files)


def long_chain_with_a_cycle(length: int = 3000) -> bytes:
    """t0 <- t1 <- ... <- t{n-1}, and t0 depends on the last: one cycle n tasks long."""
    tasks = [
        {"id": f"t{i}", "function": "demo.steps:a", "dependencies": [f"t{(i - 1) % length}"]}
        for i in range(length)
    ]
    files = package_files()
    files["cloacina.toml"] = manifest_toml(tasks)
    return build_archive(files)


HOSTILE = {
    **{name: (make, status, problem) for name, (make, status, problem) in BAD_UPLOADS.items()},
    "zip-bomb": (zip_bomb, 400, "expands to more than"),
    "gzip-bomb": (gzip_bomb, 400, "expands to more than"),
    "long-cycle": (long_chain_with_a_cycle, 422, "dependency cycle: t"),
    "huge-priority": (lambda: manifest_with(priority=10**20), 422, "priority must be an integer"),
    "huge-retries": (lambda: manifest_with(retries=10**12), 422, "retries must be at most 100"),
    "week-long-timeout": (lambda: manifest_with(timeout_s=1e300), 422, "timeout_s must be at most"),
    "huge-backoff": (lambda: manifest_with(retry_backoff_s=1e12), 422, "retry_backoff_s"),
}


def _nothing_stored() -> None:
    from artifacts.models import ArtifactBlob, PackageArtifact, WorkflowPackage

    assert WorkflowPackage.objects.count() == 0
    assert PackageArtifact.objects.count() == 0
    assert ArtifactBlob.objects.count() == 0


def test_hostile_packages_are_refused_and_the_server_keeps_serving(served):
    baseline = served.rss_mb()
    peak = baseline
    for name, (make, status, problem) in HOSTILE.items():
        data = make()
        response = served.post("/packages", files={"file": (f"{name}.bin", data)})
        assert response.status_code == status, (name, response.text[:500])
        assert problem in response.json()["detail"], (name, response.json())
        _nothing_stored()
        peak = max(peak, served.rss_mb())
    print(f"\nserver memory: {baseline:.0f} MB before, {peak:.0f} MB at the peak")
    assert peak - baseline < MEMORY_GROWTH_MAX_MB
    served.assert_still_serving()
    # …and a good package still goes in.
    response = served.post("/packages", files={"file": ("ok.tar.gz", example_archive())})
    assert response.status_code == 201, response.text


PARSE_BOMB_GROWTH_MAX_MB = 100  # the bomb cost the server 1.6 GB before


class _PeakRss:
    """Samples the RSS of the `serve` process itself every 10 ms while in the block (the
    parsing child is another process, capped by its own address-space limit)."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.baseline = self.peak = self._mb()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _mb(self) -> float:
        return self.process.memory_info().rss / 1024 / 1024

    def _sample(self) -> None:
        while not self._done.wait(0.01):
            self.peak = max(self.peak, self._mb())

    def __enter__(self) -> _PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, self._mb())


def _parse_bomb_against(served: Served, problem: str) -> tuple[float, float]:
    """Upload the parse bomb; returns (seconds to the answer, MB the server's peak RSS grew)."""
    data = parse_bomb()  # 4 MB of source in ~6 KB
    with _PeakRss(served.server.process.pid) as rss:
        start = time.monotonic()
        response = served.post("/packages", files={"file": ("bomb.tar.gz", data)})
        elapsed = time.monotonic() - start
    assert response.status_code == 413, response.text[:500]
    assert problem in response.json()["detail"], response.json()
    _nothing_stored()
    served.assert_still_serving()
    return elapsed, rss.peak - rss.baseline


def test_a_parse_bomb_is_refused_quickly_and_the_server_barely_grows(served):
    """Default limits: refused by CLOACINA_MAX_MODULE_SOURCE_BYTES before any parse. RSS is
    the real `serve` process's: its peak during the request over its value before."""
    elapsed, grown = _parse_bomb_against(
        served, "at most 1048576 (CLOACINA_MAX_MODULE_SOURCE_BYTES)"
    )
    print(f"\nparse bomb, default limits: 413 in {elapsed:.2f} s, serve peak RSS {grown:+.1f} MB")
    assert elapsed < 5 and grown < PARSE_BOMB_GROWTH_MAX_MB


def test_a_parse_bomb_past_the_source_limit_runs_out_of_the_childs_memory(
    transactional_db, tmp_path
):
    """CLOACINA_MAX_MODULE_SOURCE_BYTES raised to 8 MB, so the bomb is parsed: in the child
    capped at CLOACINA_VALIDATION_MEMORY_BYTES (256 MiB), never in `serve`. RSS is the real
    `serve` process's: its peak during the request over its value before."""
    keys = tenant_keys()
    with Processes(tmp_path) as procs:
        server = procs.serve(env=procs.env(CLOACINA_MAX_MODULE_SOURCE_BYTES=str(8 * 1024 * 1024)))
        elapsed, grown = _parse_bomb_against(
            Served(procs, server, keys),
            "parsing it needs more than 268435456 bytes of memory "
            "(CLOACINA_VALIDATION_MEMORY_BYTES)",
        )
    print(
        f"\nparse bomb, parsed in the child: 413 in {elapsed:.2f} s, serve peak RSS {grown:+.1f} MB"
    )
    assert elapsed < 30 and grown < PARSE_BOMB_GROWTH_MAX_MB

"""What the agent tells the server about its host in registrations and heartbeats.

The keys match the per-task routing keys of a package manifest (``min_free_memory_mb``,
``min_free_cpu_pct``, ``min_free_vram_pct``) and the fallback score of agent selection
(``free_cpu_pct`` + ``memory_free_pct`` [+ ½ ``free_vram_pct``]), so the server
compares them directly (docs/routing.md):

* CPU: ``cpu_count``, ``cpu_pct`` (busy), ``free_cpu_pct``, ``load_1m``;
* memory: ``memory_total_mb``, ``memory_used_mb``, ``memory_cached_mb``,
  ``free_memory_mb`` (available), ``memory_free_pct``;
* disk (the filesystem of the agent's working directory, by statfs): ``disk_total_mb``,
  ``disk_used_mb``, ``disk_free_mb``;
* GPUs, when ``nvidia-smi`` is on the PATH: ``gpu_count``, ``gpus`` (index, name,
  utilisation, VRAM total/used/free %, temperature each), ``gpu_util_pct`` (mean) and
  ``free_vram_pct`` (the GPU with the most free memory).

``nvidia-smi`` takes tens of milliseconds to seconds, and heartbeats are built on the
agent's event loop: it is queried on a background thread at most every
``GPU_SAMPLE_S`` and heartbeats carry the latest reading (the first sample, at start,
waits for it).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from typing import Any

import psutil

GPU_SAMPLE_S = 10.0
NVIDIA_SMI_TIMEOUT_S = 3.0
MAX_GPUS_REPORTED = 16  # heartbeat metrics are capped at 16 KiB
_GPU_QUERY = "index,name,utilization.gpu,memory.total,memory.used,temperature.gpu"
MB = 1024 * 1024


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def parse_nvidia_smi(output: str) -> list[dict[str, Any]]:
    """The GPUs of ``nvidia-smi --query-gpu=<_GPU_QUERY> --format=csv,noheader,nounits``."""
    gpus = []
    for line in output.splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) != 6:
            continue
        index, name, util, total, used, temperature = fields
        gpu: dict[str, Any] = {"index": int(_number(index) or 0), "name": name[:100]}
        gpu["util_pct"] = _number(util)
        gpu["vram_total_mb"] = _number(total)
        gpu["vram_used_mb"] = _number(used)
        if gpu["vram_total_mb"] and gpu["vram_used_mb"] is not None:
            free = 100.0 * (1 - gpu["vram_used_mb"] / gpu["vram_total_mb"])
            gpu["vram_free_pct"] = round(max(0.0, free), 1)
        gpu["temperature_c"] = _number(temperature)
        gpus.append(gpu)
    return gpus[:MAX_GPUS_REPORTED]


def gpu_summary(gpus: list[dict[str, Any]]) -> dict[str, Any]:
    """The heartbeat keys for these GPUs ({} when there are none)."""
    if not gpus:
        return {}
    summary: dict[str, Any] = {"gpu_count": len(gpus), "gpus": gpus}
    utils = [g["util_pct"] for g in gpus if g.get("util_pct") is not None]
    if utils:
        summary["gpu_util_pct"] = round(sum(utils) / len(utils), 1)
    free = [g["vram_free_pct"] for g in gpus if g.get("vram_free_pct") is not None]
    if free:
        summary["free_vram_pct"] = max(free)
    return summary


class GpuProbe:
    """The latest ``nvidia-smi`` reading, refreshed in the background."""

    def __init__(self, executable: str | None = None, interval_s: float = GPU_SAMPLE_S) -> None:
        self._executable = executable
        self._interval_s = interval_s
        self._lock = threading.Lock()
        self._reading: dict[str, Any] = {}
        self._taken_at: float | None = None
        self._refreshing = False

    def _query(self) -> dict[str, Any]:
        executable = self._executable or shutil.which("nvidia-smi")
        if executable is None:
            return {}
        try:
            done = subprocess.run(
                [executable, f"--query-gpu={_GPU_QUERY}", "--format=csv,noheader,nounits"],
                capture_output=True,
                text=True,
                timeout=NVIDIA_SMI_TIMEOUT_S,
            )
        except (OSError, subprocess.TimeoutExpired):
            return {}
        if done.returncode != 0:
            return {}  # no driver, no device: report no GPU rather than a stale one
        return gpu_summary(parse_nvidia_smi(done.stdout))

    def _refresh(self) -> None:
        reading = self._query()
        with self._lock:
            self._reading, self._taken_at, self._refreshing = reading, time.monotonic(), False

    def reading(self) -> dict[str, Any]:
        """The latest reading; the first call waits for one, later calls never block."""
        with self._lock:
            first = self._taken_at is None and not self._refreshing
            stale = self._taken_at is not None and (
                time.monotonic() - self._taken_at >= self._interval_s
            )
            start = (first or stale) and not self._refreshing
            if start:
                self._refreshing = True
        if first:
            self._refresh()
        elif start:
            threading.Thread(target=self._refresh, name="gpu-probe", daemon=True).start()
        with self._lock:
            return dict(self._reading)


_gpus = GpuProbe()


def sample(gpus: GpuProbe | None = None) -> dict[str, Any]:
    """A cheap snapshot (no blocking: cpu_percent compares with the previous call)."""
    memory = psutil.virtual_memory()
    busy_pct = psutil.cpu_percent(interval=None)
    metrics: dict[str, Any] = {
        "cpu_count": os.cpu_count() or 1,
        "cpu_pct": round(busy_pct, 1),
        "free_cpu_pct": round(100.0 - busy_pct, 1),
        "load_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "memory_total_mb": round(memory.total / MB),
        "memory_used_mb": round(memory.used / MB),
        "memory_cached_mb": round(getattr(memory, "cached", 0) / MB),
        "free_memory_mb": round(memory.available / MB),
        "memory_free_pct": round(100.0 * memory.available / memory.total, 1),
    }
    try:
        disk = psutil.disk_usage(os.getcwd())
    except OSError:
        pass
    else:
        metrics.update(
            disk_total_mb=round(disk.total / MB),
            disk_used_mb=round(disk.used / MB),
            disk_free_mb=round(disk.free / MB),
        )
    metrics.update((gpus or _gpus).reading())
    return metrics

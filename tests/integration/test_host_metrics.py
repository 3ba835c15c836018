"""The host metrics an agent reports (registration and every heartbeat).

There is no GPU on this machine: the nvidia-smi cases run a stand-in executable that
prints what the real one prints for ``--query-gpu … --format=csv,noheader,nounits``.

Here: the integration tests (database, in-process ASGI, fakes); the rest are in tests/unit/test_host_metrics.py.
"""

from __future__ import annotations

import json
import stat
import time

from agents.runtime import host_metrics

A100_AND_T4 = (
    "0, NVIDIA A100-SXM4-40GB, 37, 40960, 10240, 51\n1, Tesla T4, [N/A], 15360, 15000, 60\n"
)


def fake_smi(tmp_path, output: str, code: int = 0, sleep_s: float = 0.0):
    script = tmp_path / "nvidia-smi"
    script.write_text(
        f"#!/bin/sh\nsleep {sleep_s}\necho $@ >> {tmp_path / 'args'}\n"
        f"printf '%s' '{output}'\nexit {code}\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_it_reports_cpu_memory_and_disk_under_the_routing_keys():
    metrics = host_metrics.sample(host_metrics.GpuProbe(executable="/nonexistent/nvidia-smi"))
    for key in ("cpu_count", "cpu_pct", "free_cpu_pct", "memory_total_mb", "memory_used_mb",
                "free_memory_mb", "memory_free_pct", "disk_total_mb", "disk_used_mb",
                "disk_free_mb"):  # fmt: skip
        assert isinstance(metrics[key], int | float), key
    assert 0 <= metrics["memory_free_pct"] <= 100
    assert metrics["free_memory_mb"] <= metrics["memory_total_mb"]
    assert abs(metrics["cpu_pct"] + metrics["free_cpu_pct"] - 100) < 0.2
    assert "gpu_count" not in metrics  # no GPU: no GPU keys at all
    assert len(json.dumps(metrics)) < 16 * 1024


def test_gpus_are_read_from_nvidia_smi(tmp_path):
    probe = host_metrics.GpuProbe(executable=fake_smi(tmp_path, A100_AND_T4))
    metrics = host_metrics.sample(probe)
    assert metrics["gpu_count"] == 2
    assert metrics["gpus"][0] == {
        "index": 0, "name": "NVIDIA A100-SXM4-40GB", "util_pct": 37.0,
        "vram_total_mb": 40960.0, "vram_used_mb": 10240.0, "vram_free_pct": 75.0,
        "temperature_c": 51.0,
    }  # fmt: skip
    assert metrics["gpus"][1]["util_pct"] is None  # "[N/A]"
    assert metrics["free_vram_pct"] == 75.0  # the GPU with the most free memory
    assert metrics["gpu_util_pct"] == 37.0
    args = (tmp_path / "args").read_text()
    assert "--query-gpu=index,name,utilization.gpu" in args and "nounits" in args


def test_a_failing_nvidia_smi_reports_no_gpu(tmp_path):
    probe = host_metrics.GpuProbe(executable=fake_smi(tmp_path, "NVIDIA-SMI has failed", code=9))
    assert "gpu_count" not in host_metrics.sample(probe)


def test_later_readings_never_wait_for_nvidia_smi(tmp_path):
    probe = host_metrics.GpuProbe(
        executable=fake_smi(tmp_path, A100_AND_T4, sleep_s=0.5), interval_s=0
    )
    assert probe.reading()["gpu_count"] == 2  # the first one waits (at agent start)
    started = time.monotonic()
    for _ in range(5):
        assert probe.reading()["gpu_count"] == 2  # the last reading, refreshed in the background
    assert time.monotonic() - started < 0.3

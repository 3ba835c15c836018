"""What the agent tells the server about its host in registrations and heartbeats.

The keys match the per-task routing keys of a package manifest
(``min_free_memory_mb``, ``min_free_cpu_pct``), so the server can compare them directly.
"""

from __future__ import annotations

import os
from typing import Any

import psutil


def sample() -> dict[str, Any]:
    """A cheap snapshot (no blocking: cpu_percent compares with the previous call)."""
    memory = psutil.virtual_memory()
    busy_pct = psutil.cpu_percent(interval=None)
    return {
        "free_memory_mb": round(memory.available / (1024 * 1024)),
        "free_cpu_pct": round(100.0 - busy_pct, 1),
        "cpu_count": os.cpu_count() or 1,
        "load_1m": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
    }

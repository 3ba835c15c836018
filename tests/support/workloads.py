"""Small workflows for the end-to-end tests: package archives whose tasks sleep, leave
markers and count their runs, so a test can tell where and how often a task ran."""

from __future__ import annotations

from pathlib import Path

from artifacts.store.testing import build_archive, manifest_toml

STEPS_SOURCE = '''
import os
import time
from pathlib import Path


def slow(context):
    """Appends this run's pid to context["runs"], marks context["started"], sleeps."""
    with open(context["runs"], "a") as fh:
        fh.write(f"{os.getpid()}\\n")
    Path(context["started"]).write_text("started")
    time.sleep(float(context.get("sleep_s", 0)))
    return {"slept_s": context.get("sleep_s", 0)}


def quick(context):
    return {"n": context.get("n", 0) + 1}
'''

SLOW_ONCE_SOURCE = '''
import os
import time
from pathlib import Path


def slow_once(context):
    """The first run (anywhere) leaves a marker and takes long; any later run is quick."""
    marker = Path(context["marker"])
    if not marker.exists():
        marker.write_text(str(os.getpid()))
        time.sleep(float(context.get("sleep_s", 30)))
        return {"who": "first"}
    return {"who": "second"}


def quick(context):
    time.sleep(float(context.get("quick_s", 0)))
    return {"quick": context.get("n", 0)}
'''

SLOW_TASKS = """
import time

def slow(ctx):
    time.sleep(float(ctx.get("sleep_s", 2.0)))
    return {"slept": True}
"""


GATED_TASKS = """
import time
from pathlib import Path

def held(ctx):
    # Holds its slot until the test creates ctx["gate"] (bounded, so a broken test cannot
    # leave a task running forever): load that lasts exactly as long as the test needs.
    gate, deadline = Path(ctx["gate"]), time.monotonic() + float(ctx.get("hold_max_s", 120))
    while not gate.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gate {gate} never opened")
        time.sleep(0.05)
    return {"held": True}
"""


def agent_package(name: str = "agentpkg", workflow: str = "agentwf", task: str = "slow") -> bytes:
    """A one-task python package (``slow`` or ``quick`` from :data:`STEPS_SOURCE`)."""
    tasks = [{"id": task, "function": f"agentsteps.steps:{task}", "timeout_s": 60}]
    return build_archive(
        {
            "cloacina.toml": manifest_toml(tasks, name=name, workflow=workflow),
            "workflow/agentsteps/__init__.py": "",
            "workflow/agentsteps/steps.py": STEPS_SOURCE,
        }
    )


def slow_context(tmp_path: Path, sleep_s: float, label: str = "run") -> dict:
    return {
        "runs": str(tmp_path / f"{label}-runs.txt"),
        "started": str(tmp_path / f"{label}-started"),
        "sleep_s": sleep_s,
    }


def runs_of(context: dict) -> int:
    """How many times the slow task actually started (one line per run)."""
    path = Path(context["runs"])
    return len(path.read_text().splitlines()) if path.exists() else 0

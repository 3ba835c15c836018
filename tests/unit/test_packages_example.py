"""The etl-demo example behaves as documented when its tasks run in DAG order."""

from __future__ import annotations

import importlib
import sys

import pytest

from agents.sandbox import archive
from artifacts.store.testing import example_archive


@pytest.fixture
def steps(tmp_path):
    """The example's steps module, imported from an extracted artifact as an agent would."""
    archive.safe_extract(example_archive(), tmp_path / "pkg")
    sys.path.insert(0, str(tmp_path / "pkg" / "workflow"))
    try:
        yield importlib.import_module("etl_demo.steps")
    finally:
        sys.path.remove(str(tmp_path / "pkg" / "workflow"))
        for name in [m for m in sys.modules if m.split(".")[0] == "etl_demo"]:
            del sys.modules[name]


def run_diamond(steps, context: dict) -> dict:
    context = {**context, **steps.extract(context)}
    context = {**context, **steps.transform_a(context), **steps.transform_b(context)}
    return {**context, **steps.load(context)}


def test_the_diamond_produces_its_report(steps):
    result = run_diamond(steps, {})
    assert result["rows"] == [1, 2, 3] and result["sum"] == 6 and result["max"] == 3
    assert result["loaded"] is True and "sum=6" in result["report"]


def test_extract_fails_once_then_succeeds(steps, tmp_path):
    context = {"fail_once": True, "marker_path": str(tmp_path / "marker")}
    with pytest.raises(RuntimeError, match="simulated transient failure"):
        steps.extract(context)
    assert (tmp_path / "marker").exists()
    assert steps.extract(context) == {"rows": [1, 2, 3]}

"""Tasks of the etl-demo workflow.

Each task takes the merged input context (a dict) and returns the keys it
adds.  ``extract`` can fail once on purpose so retries can be demonstrated
and tested: with ``{"fail_once": true, "marker_path": "/tmp/x"}`` in the
input it creates the marker and raises; the retry finds the marker and
succeeds.
"""

from __future__ import annotations

from pathlib import Path

DEFAULT_ROWS = [1, 2, 3]


class TransientExtractError(RuntimeError):
    """The deliberate first-attempt failure of ``extract``."""


def extract(context: dict) -> dict:
    if context.get("fail_once"):
        if not context.get("marker_path"):
            raise ValueError("fail_once needs marker_path: the file that records the first failure")
        marker = Path(context["marker_path"])
        if not marker.exists():
            marker.write_text("extract failed once\n")
            raise TransientExtractError(f"simulated transient failure (marker {marker} created)")
    return {"rows": list(context.get("input_rows", DEFAULT_ROWS))}


def transform_a(context: dict) -> dict:
    return {"sum": sum(context["rows"])}


def transform_b(context: dict) -> dict:
    return {"max": max(context["rows"])}


def load(context: dict) -> dict:
    rows = context["rows"]
    report = f"loaded {len(rows)} rows: sum={context['sum']} max={context['max']}"
    return {"loaded": True, "report": report}

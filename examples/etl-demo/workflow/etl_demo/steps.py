"""Tasks of the etl-demo workflow.

Each task takes the merged input context (a dict) and returns the keys it
adds.  ``extract`` can fail once on purpose so retries can be demonstrated
and tested: with ``{"fail_once": true, "marker_path": "/tmp/x"}`` in the
input it creates the marker and raises; the retry finds the marker and
succeeds.

What a task prints and logs is its log (``GET …/tasks/{task}/logs``, the console's
execution page): ``extract`` and ``load`` say what they do.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("etl_demo")

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
            log.warning("first attempt: failing on purpose (fail_once)")
            raise TransientExtractError(f"simulated transient failure (marker {marker} created)")
    rows = list(context.get("input_rows", DEFAULT_ROWS))
    print(f"extracted {len(rows)} rows")
    log.info("rows: %s", rows)
    return {"rows": rows}


def transform_a(context: dict) -> dict:
    return {"sum": sum(context["rows"])}


def transform_b(context: dict) -> dict:
    return {"max": max(context["rows"])}


def load(context: dict) -> dict:
    rows = context["rows"]
    report = f"loaded {len(rows)} rows: sum={context['sum']} max={context['max']}"
    print(report)
    return {"loaded": True, "report": report}

"""The wire codec (agents/protocol/wire.py): round trips, and wrong-format frames refused.

Here: the integration tests (database, in-process ASGI, fakes); the rest are in tests/unit/test_wire.py.
"""

from __future__ import annotations

import subprocess
import sys

from tests.support.processes import REPO


def test_the_codec_is_db_free():
    """The agent runtime imports it: it must pull in neither Django models nor a DB driver."""
    code = (
        "import sys; import agents.protocol.wire as w; "
        "w.decode(w.encode({'a': 1}, 'msgpack'), 'msgpack'); "
        "bad = [m for m in sys.modules if m.startswith(('django', 'psycopg'))]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    run = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr

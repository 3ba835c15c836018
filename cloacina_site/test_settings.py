"""Settings for the test run: a private CLOACINA_HOME (own embedded PostgreSQL) unless given."""

import os
import tempfile
from pathlib import Path

os.environ.setdefault("CLOACINA_HOME", str(Path(tempfile.gettempdir()) / "cloacina-test-home"))
Path(os.environ["CLOACINA_HOME"]).mkdir(parents=True, exist_ok=True)
os.environ.setdefault("CLOACINA_SECRET_KEY", "test-secret-key-not-for-production")

from cloacina_site.settings import *  # noqa: E402,F403

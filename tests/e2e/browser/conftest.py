"""Real headless Chromium (Debian's /usr/bin/chromium) driven by Playwright against a live server.

The live server is pytest-django's threaded WSGI server (no Channels needed for
the console).  Tests skip, with the reason, when chromium is not installed.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("CLOACINA_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
# Where the screenshots of the main pages go; docs/screenshots/ is refreshed with
# CLOACINA_SCREENSHOT_DIR=docs/screenshots (see docs/console.md).
SCREENSHOT_DIR_ENV = "CLOACINA_SCREENSHOT_DIR"


# Package scope, not session: the sync Playwright loop must be gone before the
# rest of the suite's asyncio tests run in this thread.
@pytest.fixture(scope="package")
def chromium():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is not installed (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    # Playwright's sync API keeps an asyncio loop running in the test thread, which
    # trips Django's async-safety guard on every ORM call the test itself makes.  The
    # test thread really is synchronous, so the guard is off while the browser lives.
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS
            )
            yield browser
            browser.close()
    finally:
        if previous is None:
            os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        else:
            os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def page(chromium):
    context = chromium.new_context(viewport={"width": 1440, "height": 900})
    page = context.new_page()
    page.set_default_timeout(10_000)
    yield page
    context.close()


@pytest.fixture
def screenshot_dir(tmp_path) -> Path:
    path = Path(os.environ.get(SCREENSHOT_DIR_ENV) or tmp_path)
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(autouse=True)
def fast_polling(monkeypatch):
    """Live partials poll every 0.5 s instead of 2 s, so waiting for an update stays short."""
    from fleet.templatetags import console_format

    monkeypatch.setattr(console_format, "POLL_INTERVAL_S", 0.5)

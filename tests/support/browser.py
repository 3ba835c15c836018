"""Helpers for the browser tests (tests/e2e/browser/): acting through the real console."""

from __future__ import annotations


def login(page, live_server, username: str, password: str) -> None:
    """Sign in through the console's login form and wait for the overview."""
    page.goto(f"{live_server.url}/console/")
    page.fill("input[name=username]", username)
    page.fill("input[name=password]", password)
    page.click("button[type=submit]")
    page.wait_for_url(f"{live_server.url}/console/")

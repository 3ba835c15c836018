"""`manage.py runagent` as a command: its flags, environment fallbacks and exit codes.

No server is needed here: a closed port stands in for one that is not up yet.

Here: the end-to-end tests (real processes); the rest are in tests/unit/test_agent_runtime_cli.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.support.processes import MANAGE, REPO, free_port

SECRET = "clk_0123456789ab_this-is-the-secret-part-of-the-key"


def _env(tmp_path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CLOACINA_")}
    env.pop("DJANGO_SETTINGS_MODULE", None)
    env.update(CLOACINA_HOME=str(tmp_path / "home"), PYTHONUNBUFFERED="1", **extra)
    return env


def _runagent(tmp_path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, MANAGE, "runagent", *args],
        cwd=REPO,
        env=_env(tmp_path, **env),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_bad_flag_exits_2_with_one_line_on_stderr(tmp_path):
    done = _runagent(
        tmp_path, "--server", "http://127.0.0.1:9", "--api-key", SECRET, "--target-triple", "x86"
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--target-triple: malformed target triple 'x86'" in lines[0]


def test_env_fallbacks_keep_the_key_off_the_command_line_and_out_of_the_log(tmp_path):
    port = free_port()  # nothing listens: the agent keeps trying to register
    log_path = tmp_path / "agent.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, MANAGE, "runagent", "--name", "env-agent"],
            cwd=REPO,
            env=_env(
                tmp_path,
                CLOACINA_SERVER_URL=f"http://127.0.0.1:{port}",
                CLOACINA_AGENT_API_KEY=SECRET,
            ),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline = time.monotonic() + 30
            while "cannot register" not in log_path.read_text() and time.monotonic() < deadline:
                assert process.poll() is None, log_path.read_text()
                time.sleep(0.05)
            assert f"127.0.0.1:{port}" in log_path.read_text()  # the URL came from the env
            # SIGTERM before it ever registered: nothing to drain or deregister, exit 0.
            process.send_signal(signal.SIGTERM)
            assert process.wait(15) == 0
        finally:
            if process.poll() is None:
                process.kill()
    text = log_path.read_text()
    assert "drained (not registered: nothing to deregister)" in text
    # uvloop by default; its signal handlers (loop.add_signal_handler) took the SIGTERM above.
    assert "event loop: uvloop" in text
    assert SECRET not in text and "this-is-the-secret" not in text
    # Its default cache directory lives under CLOACINA_HOME.
    assert (tmp_path / "home" / "agent-cache").is_dir()


def test_an_unknown_event_loop_exits_2_with_one_line_on_stderr(tmp_path):
    done = _runagent(
        tmp_path, "--server", "http://127.0.0.1:9", "--api-key", SECRET, CLOACINA_EVENT_LOOP="tokio"
    )
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "CLOACINA_EVENT_LOOP must be one of uvloop, asyncio, got 'tokio'" in lines[0]

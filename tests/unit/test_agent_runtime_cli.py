"""`manage.py runagent` as a command: its flags, environment fallbacks and exit codes.

No server is needed here: a closed port stands in for one that is not up yet.

Here: the unit tests (no database, socket or process); the rest are in tests/e2e/test_agent_runtime_cli.py.
"""

from __future__ import annotations

import pytest
from django.core.management import CommandError, call_command

from agents.management.commands import runagent

SECRET = "clk_0123456789ab_this-is-the-secret-part-of-the-key"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--target-triple", "x86_64-linux"], "--target-triple: malformed target triple"),
        (["--target-triple", "sparc-unknown-linux-gnu"], "unknown architecture 'sparc'"),
        (["--max-concurrency", "0"], "--max-concurrency must be at least 1"),
        (["--cache-max-mb", "0"], "--cache-max-mb must be at least 1"),
        (["--server", "localhost:8000"], "server URL must look like http://host:port"),
        (["--server", ""], "--server (or CLOACINA_SERVER_URL) is required"),
        (["--api-key", ""], "--api-key (or CLOACINA_AGENT_API_KEY) is required"),
        (["--name", "  "], "--name must not be empty"),
    ],
)
def test_bad_flags_are_refused_with_exit_code_2(monkeypatch, args, message):
    # In this process: the command must refuse before it guards the database or runs.
    def unreachable(*_args, **_kwargs):
        raise AssertionError("the command got past its flag checks")

    monkeypatch.setattr(runagent, "install_db_guard", lambda: None)
    monkeypatch.setattr(runagent, "_configure_logging", lambda: None)
    monkeypatch.setattr(runagent, "_run", unreachable)
    monkeypatch.delenv("CLOACINA_SERVER_URL", raising=False)
    monkeypatch.delenv("CLOACINA_AGENT_API_KEY", raising=False)
    flags = {"--server": "http://127.0.0.1:9", "--api-key": SECRET}
    flags.update(zip(args[::2], args[1::2], strict=True))
    with pytest.raises(CommandError) as info:
        call_command("runagent", *[part for item in flags.items() for part in item])
    assert info.value.returncode == 2
    assert message in str(info.value) and SECRET not in str(info.value)


class _Configured(Exception):
    """Raised once the command has built its AgentConfig (nothing is run)."""


@pytest.mark.parametrize(
    "env, expected",
    [(None, "msgpack"), ("auto", "msgpack"), ("json", "json"), ("msgpack", "msgpack")],
)
def test_the_agent_speaks_msgpack_unless_told_json(monkeypatch, env, expected):
    monkeypatch.setattr(runagent, "install_db_guard", lambda: None)
    monkeypatch.setattr(runagent, "_configure_logging", lambda: None)
    if env is None:
        monkeypatch.delenv("CLOACINA_WIRE_FORMAT", raising=False)
    else:
        monkeypatch.setenv("CLOACINA_WIRE_FORMAT", env)
    built = runagent.Command._config

    def stop_after_config(self, options):
        raise _Configured(built(self, options).wire_format)

    monkeypatch.setattr(runagent.Command, "_config", stop_after_config)
    with pytest.raises(_Configured) as info:
        call_command("runagent", "--server", "http://127.0.0.1:9", "--api-key", SECRET)
    assert str(info.value) == expected

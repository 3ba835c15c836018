"""Choosing the event loop (agents/protocol/event_loop.py): uvloop by default, the standard
loop on request or where uvloop cannot be imported; the server's setting is checked at boot."""

from __future__ import annotations

import asyncio
import sys

import pytest

from agents.protocol import event_loop
from agents.protocol.event_loop import (
    EventLoopChoiceError,
    install_event_loop_policy,
    parse_choice,
    running_loop_kind,
)
from fleet.platform.config import ConfigError, load_config


@pytest.fixture(autouse=True)
def restore_policy():
    yield
    asyncio.set_event_loop_policy(None)


def _new_loop_kind() -> str:
    loop = asyncio.new_event_loop()
    try:
        return running_loop_kind(loop)
    finally:
        loop.close()


@pytest.mark.parametrize(
    "raw, expected",
    [(None, "uvloop"), ("", "uvloop"), (" UVLoop ", "uvloop"), ("asyncio", "asyncio")],
)
def test_parse_choice(raw, expected):
    assert parse_choice(raw) == expected


def test_an_unknown_loop_is_refused():
    with pytest.raises(EventLoopChoiceError, match="must be one of uvloop, asyncio, got 'tokio'"):
        parse_choice("tokio")


def test_uvloop_by_default_and_the_standard_loop_on_request(monkeypatch):
    monkeypatch.delenv(event_loop.ENV_EVENT_LOOP, raising=False)
    assert install_event_loop_policy() == "uvloop"
    assert _new_loop_kind() == "uvloop"
    monkeypatch.setenv(event_loop.ENV_EVENT_LOOP, "asyncio")
    assert install_event_loop_policy() == "asyncio"
    assert _new_loop_kind() == "asyncio"


def test_the_standard_loop_where_uvloop_cannot_be_imported(monkeypatch):
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import uvloop raises ImportError
    assert install_event_loop_policy("uvloop") == "asyncio"
    assert _new_loop_kind() == "asyncio"


def test_the_server_reads_the_setting_from_env_and_config_toml(tmp_path):
    env = {"CLOACINA_HOME": str(tmp_path)}
    assert load_config(env).event_loop == "uvloop"
    (tmp_path / "config.toml").write_text('[server]\nevent_loop = "asyncio"\n')
    assert load_config(env).event_loop == "asyncio"
    with pytest.raises(ConfigError, match="CLOACINA_EVENT_LOOP must be one of"):
        load_config({**env, "CLOACINA_EVENT_LOOP": "tokio"})


@pytest.mark.parametrize("choice, expected", [("uvloop", "uvloop"), ("asyncio", "asyncio")])
def test_loop_factory_makes_the_chosen_loop_and_leaves_the_policy_alone(choice, expected):
    policy = asyncio.get_event_loop_policy()
    loop = event_loop.loop_factory(choice)()
    try:
        assert running_loop_kind(loop) == expected
    finally:
        loop.close()
    assert asyncio.get_event_loop_policy() is policy


def test_runagent_runs_on_uvloop_without_changing_the_process_policy(monkeypatch, tmp_path):
    """A policy installed by runagent leaked into every later test's loops in its process
    (uvloop's millisecond clock then failed a timing test): it passes a loop factory."""
    from django.core.management import call_command

    from agents.management.commands import runagent

    kinds: list[str] = []

    async def capture(agent) -> int:
        kinds.append(running_loop_kind(asyncio.get_running_loop()))
        return 0

    monkeypatch.setattr(runagent, "install_db_guard", lambda: None)
    monkeypatch.setattr(runagent, "_configure_logging", lambda: None)
    monkeypatch.setattr(runagent, "freeze_startup_heap", lambda: 0)  # not this test process
    monkeypatch.setattr(runagent, "_run", capture)
    monkeypatch.delenv(event_loop.ENV_EVENT_LOOP, raising=False)
    policy = asyncio.get_event_loop_policy()
    call_command(
        "runagent", "--api-key", "k", "--server", "http://a:1", "--cache-dir", str(tmp_path)
    )
    assert kinds == ["uvloop"]
    assert asyncio.get_event_loop_policy() is policy

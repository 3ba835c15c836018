"""`serve` boot configuration: the executor registry and loud failures on bad configuration.

Here: the unit tests (no database, socket or process); the rest are in tests/e2e/test_serve_config.py.
"""

from __future__ import annotations

import pytest

from fleet.engine.events import ExecutorNotFound
from fleet.executors.registry import build_dispatcher
from fleet.platform.config import load_config


def config(tmp_path, **env: str):
    return load_config({"CLOACINA_HOME": str(tmp_path), **env})


def test_default_registers_only_the_in_process_executor(tmp_path):
    dispatcher = build_dispatcher(config(tmp_path), claimer="test")
    assert dispatcher.valid_keys() == ["default"]
    assert dispatcher.executor.key == "default"
    assert dispatcher.executor.workers == 4


def test_an_unknown_key_lists_the_valid_ones_and_not_fleet(tmp_path):
    with pytest.raises(ExecutorNotFound) as caught:
        build_dispatcher(config(tmp_path, CLOACINA_DEFAULT_EXECUTOR="flet"), claimer="test")
    assert str(caught.value) == "unknown default executor 'flet'; valid keys: default"


def test_fleet_is_registered_when_opted_in(tmp_path):
    pytest.importorskip("fleet.executors.fleet")
    dispatcher = build_dispatcher(config(tmp_path, CLOACINA_DEFAULT_EXECUTOR="fleet"), "test")
    assert dispatcher.valid_keys() == ["default", "fleet"]
    assert dispatcher.executor.key == "fleet"

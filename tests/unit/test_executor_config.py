"""Executors registered from configuration: the [executors] table, CLOACINA_EXECUTORS, and the
boot errors for every way an entry can be wrong (docs/executors.md)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest

from agents.sandbox.task_limits import ChildLimits
from examples.executors.subprocess_limits import SubprocessLimitsExecutor
from fleet.api.metrics import ExecutorCollector
from fleet.engine.events import ExecutionResult, ExecutorMetrics, ExecutorNotFound, TaskReadyEvent
from fleet.engine.executor import TaskExecutor
from fleet.executors import registry
from fleet.executors.registry import build_dispatcher
from fleet.platform.config import BUILTIN_EXECUTOR_KEYS, Config, ConfigError, load_config

EXAMPLE = "examples.executors.subprocess_limits:SubprocessLimitsExecutor"


class RecordingExecutor(TaskExecutor):
    """A concrete executor that keeps what it was built with."""

    def __init__(self, claimer: str, config: Config, capacity: int = 1) -> None:
        self.claimer = claimer
        self.config = config
        self.capacity = capacity

    async def execute(self, event: TaskReadyEvent) -> ExecutionResult:
        raise NotImplementedError("never dispatched to in these tests")

    def has_capacity(self) -> bool:
        return True

    def metrics(self) -> ExecutorMetrics:
        return ExecutorMetrics(max_concurrent=self.capacity)


class CheckedOptions(RecordingExecutor):
    @classmethod
    def from_config(
        cls, options: Mapping[str, Any], *, key: str, claimer: str, config: Config
    ) -> TaskExecutor:
        if options.get("capacity", 1) > 8:
            raise ValueError("capacity must be at most 8")
        return cls(claimer, config, **options)


class Abstract(TaskExecutor):
    def has_capacity(self) -> bool:
        return True


class NotAnExecutor:
    pass


HERE = __name__


def write_toml(tmp_path, text: str) -> None:
    (tmp_path / "config.toml").write_text(text)


def config(tmp_path, **env: str) -> Config:
    return load_config({"CLOACINA_HOME": str(tmp_path), **env})


def test_the_builtin_keys_the_config_refuses_are_the_registry_s():
    assert BUILTIN_EXECUTOR_KEYS == (registry.DEFAULT_KEY, registry.FLEET_KEY)


def test_a_toml_entry_is_registered_built_with_its_options_and_can_be_the_default(tmp_path):
    write_toml(
        tmp_path,
        f"""
[server]
default_executor = "mine"

[executors.mine]
class = "{HERE}:RecordingExecutor"
options = {{ capacity = 3 }}
""",
    )
    dispatcher = build_dispatcher(config(tmp_path), claimer="server-1")
    assert dispatcher.valid_keys() == ["default", "mine"]
    executor = dispatcher.executor
    assert type(executor) is RecordingExecutor
    assert (executor.key, executor.claimer, executor.capacity) == ("mine", "server-1", 3)
    assert executor.config.home == tmp_path


def test_the_environment_gives_the_same_shape_and_wins_for_a_key_in_both(tmp_path):
    write_toml(
        tmp_path,
        f"""
[executors.mine]
class = "{HERE}.RecordingExecutor"
options = {{ capacity = 3 }}

[executors.other]
class = "{HERE}:RecordingExecutor"
""",
    )
    env = {"mine": {"class": f"{HERE}:RecordingExecutor", "options": {"capacity": 5}}}
    loaded = config(tmp_path, CLOACINA_EXECUTORS=json.dumps(env))
    assert sorted(loaded.executors) == ["mine", "other"]
    assert loaded.executors["mine"].options == {"capacity": 5}
    assert loaded.executors["mine"].source == "CLOACINA_EXECUTORS[mine]"
    assert loaded.executors["other"].source == "[executors.other] in config.toml"
    dispatcher = build_dispatcher(loaded, claimer="s")
    assert dispatcher.valid_keys() == ["default", "mine", "other"]
    assert dispatcher.executor.key == "default"  # registered is not selected


def test_an_unknown_default_lists_the_builtin_and_the_configured_keys(tmp_path):
    write_toml(tmp_path, f'[executors.mine]\nclass = "{HERE}:RecordingExecutor"\n')
    with pytest.raises(ExecutorNotFound) as caught:
        build_dispatcher(config(tmp_path, CLOACINA_DEFAULT_EXECUTOR="mien"), claimer="s")
    assert str(caught.value) == "unknown default executor 'mien'; valid keys: default, mine"


@pytest.mark.parametrize(
    "entry, message",
    [
        ('[executors.default]\nclass = "a.b:C"', "executor 'default' ([executors.default] in"),
        ('[executors.fleet]\nclass = "a.b:C"', "the key is built in (default, fleet)"),
        ('[executors.Big]\nclass = "a.b:C"', "a key is 1-63 characters"),
        ("[executors.mine]\nclass = 3", "class must be a dotted path"),
        ('[executors.mine]\nclass = "no-dots here"', "class must be a dotted path"),
        ("[executors.mine]\noptions = {}", "class must be a dotted path"),
        ('[executors.mine]\nclass = "a.b:C"\nopts = {}', "unknown field(s) opts"),
        ('[executors.mine]\nclass = "a.b:C"\noptions = 4', "options must be a table"),
        ('executors = "x"', "[executors] must be a table"),
    ],
)
def test_a_malformed_toml_entry_is_refused_when_the_config_loads(tmp_path, entry, message):
    write_toml(tmp_path, entry + "\n")
    with pytest.raises(ConfigError) as caught:
        config(tmp_path)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "raw, message",
    [
        ("{not json", "CLOACINA_EXECUTORS must be a JSON object"),
        ('["a"]', "CLOACINA_EXECUTORS must be a JSON object"),
        ('{"mine": "a.b:C"}', "executor 'mine' (CLOACINA_EXECUTORS[mine]): must be a table"),
    ],
)
def test_a_malformed_environment_entry_is_refused(tmp_path, raw, message):
    with pytest.raises(ConfigError) as caught:
        config(tmp_path, CLOACINA_EXECUTORS=raw)
    assert message in str(caught.value)


@pytest.mark.parametrize(
    "class_path, options, message",
    [
        ("no_such_module_xyz:Thing", {}, "cannot import module 'no_such_module_xyz'"),
        (f"{HERE}:Missing", {}, f"module '{HERE}' has no attribute 'Missing'"),
        (f"{HERE}:NotAnExecutor", {}, "is not a TaskExecutor subclass"),
        (f"{HERE}:HERE", {}, "is not a TaskExecutor subclass"),
        (f"{HERE}:Abstract", {}, "is abstract: it does not implement execute, metrics"),
        (f"{HERE}:RecordingExecutor", {"colour": "red"}, "unexpected keyword argument 'colour'"),
        (f"{HERE}:CheckedOptions", {"capacity": 9}, "capacity must be at most 8"),
        (EXAMPLE, {"cpu_seconds": 0}, "cpu_seconds must be a positive integer, got 0"),
        (EXAMPLE, {"memory_mb": 16}, "address_space_bytes must be >= 134217728"),
        (EXAMPLE, {"cpu_seconds": True}, "cpu_seconds must be a positive integer, got True"),
        (EXAMPLE, {"gpus": 1}, "unknown option(s) gpus"),
    ],
)
def test_an_entry_that_cannot_be_built_fails_the_boot_naming_its_key(
    tmp_path, class_path, options, message
):
    env = {"mine": {"class": class_path, "options": options}}
    loaded = config(tmp_path, CLOACINA_EXECUTORS=json.dumps(env))
    with pytest.raises(ConfigError) as caught:
        build_dispatcher(loaded, claimer="s")  # even though "default" is the one selected
    text = str(caught.value)
    assert text.startswith("executor 'mine' (CLOACINA_EXECUTORS[mine]): ")
    assert message in text
    assert "\n" not in text


def test_the_example_executor_is_built_from_its_options(tmp_path):
    options = {"workers": 2, "cpu_seconds": 30, "memory_mb": 256, "open_files": 64}
    env = {"limited": {"class": EXAMPLE, "options": options}}
    loaded = config(
        tmp_path, CLOACINA_EXECUTORS=json.dumps(env), CLOACINA_DEFAULT_EXECUTOR="limited"
    )
    executor = build_dispatcher(loaded, claimer="s").executor
    assert isinstance(executor, SubprocessLimitsExecutor)
    assert executor.workers == executor.runner.capacity == 2
    assert executor.runner.fresh_child_per_task
    assert executor.runner.limits == ChildLimits(30, 256 * 1024 * 1024, 64)
    assert executor.cache.root == tmp_path / "packages"
    assert executor.metrics().extra["limit_cpu_seconds"] == 30


def test_the_example_defaults_to_the_server_s_worker_processes(tmp_path):
    env = {"limited": {"class": EXAMPLE}}
    loaded = config(tmp_path, CLOACINA_EXECUTORS=json.dumps(env), CLOACINA_WORKER_PROCESSES="3")
    executor = build_dispatcher(loaded, claimer="s").registered()["limited"]
    assert executor.workers == 3
    assert executor.runner.limits == ChildLimits(300, 1024 * 1024 * 1024, 256)


class BrokenMetrics(RecordingExecutor):
    def metrics(self) -> ExecutorMetrics:
        raise RuntimeError("counter went missing")


def test_the_executor_collector_labels_by_key_and_survives_a_broken_executor(tmp_path):
    loaded = config(tmp_path)
    dispatcher = build_dispatcher(loaded, claimer="s")
    dispatcher.register_executor("mine", RecordingExecutor("s", loaded, capacity=5))
    dispatcher.register_executor("broken", BrokenMetrics("s", loaded))
    collector = ExecutorCollector()
    assert list(collector.collect()) == []  # no dispatcher watched: no series at all
    collector.dispatcher = dispatcher
    samples = {
        (sample.name, sample.labels["executor"]): sample.value
        for family in collector.collect()
        for sample in family.samples
    }
    assert samples[("cloacina_executor_capacity", "mine")] == 5
    assert samples[("cloacina_executor_capacity", "default")] == 4  # worker_processes
    assert samples[("cloacina_executor_selected", "default")] == 1
    assert samples[("cloacina_executor_selected", "mine")] == 0
    assert samples[("cloacina_executor_tasks_executed_total", "mine")] == 0
    assert not any(executor == "broken" for _, executor in samples)

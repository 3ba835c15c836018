"""Build the process's Dispatcher from the configuration.

``default`` (the in-process executor) is always registered.  ``fleet`` exists
only when the fleet is opted in, which is exactly ``default_executor = "fleet"``:
a server that does not use the fleet never imports it.  Every executor of the
``[executors]`` table / ``CLOACINA_EXECUTORS`` (fleet/platform/config.py) is
imported by its dotted path and built here, selected or not, so a bad entry
fails the boot whichever executor is in use (docs/executors.md).  The configured
key is then hard-matched against them all, so a typo fails at boot with the list
of valid keys.
"""

from __future__ import annotations

import importlib
import inspect

from fleet.engine.dispatcher import Dispatcher
from fleet.engine.executor import TaskExecutor
from fleet.executors.inprocess import InProcessExecutor
from fleet.platform.config import Config, ExecutorSpec

# The built-in keys; fleet/platform/config.py's BUILTIN_EXECUTOR_KEYS refuses them as
# configured keys (a unit test keeps the two in step).
DEFAULT_KEY = "default"
FLEET_KEY = "fleet"


def build_dispatcher(config: Config, claimer: str) -> Dispatcher:
    """A Dispatcher with the executors this configuration allows, configured to the default key.

    Raises :class:`fleet.engine.events.ExecutorNotFound` (listing the valid keys)
    when ``config.default_executor`` names no registered executor, and
    :class:`fleet.platform.config.ConfigError` (naming the key) for a configured
    executor that cannot be loaded or built.
    """
    dispatcher = Dispatcher(claimer)
    dispatcher.register_executor(
        DEFAULT_KEY,
        InProcessExecutor(
            workers=config.worker_processes, claimer=claimer, cache_root=config.home / "packages"
        ),
    )
    if config.default_executor == FLEET_KEY:
        # Imported lazily: the fleet (and everything it pulls in) is loaded only when opted in.
        fleet_executor = importlib.import_module("fleet.executors.fleet.executor")
        dispatcher.register_executor(
            FLEET_KEY, fleet_executor.FleetExecutor(claimer=claimer, config=config)
        )
    for spec in config.executors.values():
        dispatcher.register_executor(spec.key, build_configured(spec, config, claimer))
    dispatcher.configure(config.default_executor)
    return dispatcher


def load_executor_class(spec: ExecutorSpec) -> type[TaskExecutor]:
    """The class ``spec`` names, checked to be a concrete TaskExecutor (ConfigError if not)."""
    module_name, attribute = spec.module_and_name
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or whatever the module raised as it ran
        raise spec.error(
            f"cannot import module {module_name!r}: {type(exc).__name__}: {exc}"
        ) from None
    cls = getattr(module, attribute, None)
    if cls is None:
        raise spec.error(f"module {module_name!r} has no attribute {attribute!r}")
    if not (isinstance(cls, type) and issubclass(cls, TaskExecutor)):
        raise spec.error(
            f"{spec.class_path} is not a TaskExecutor subclass (fleet.engine.executor.TaskExecutor)"
        )
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise spec.error(f"{spec.class_path} is abstract: it does not implement {missing}")
    return cls


def build_configured(spec: ExecutorSpec, config: Config, claimer: str) -> TaskExecutor:
    """Import and build one configured executor through its ``from_config``."""
    cls = load_executor_class(spec)
    try:
        executor = cls.from_config(spec.options, key=spec.key, claimer=claimer, config=config)
    except (TypeError, ValueError) as exc:  # ConfigError is a ValueError
        raise spec.error(f"bad options {sorted(spec.options)}: {exc}") from None
    if not isinstance(executor, TaskExecutor):
        raise spec.error(
            f"{spec.class_path}.from_config returned {type(executor).__name__}, not a TaskExecutor"
        )
    return executor

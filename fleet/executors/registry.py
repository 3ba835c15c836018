"""Build the process's Dispatcher from the configuration.

``default`` (the in-process executor) is always registered.  ``fleet`` exists
only when the fleet is opted in, which is exactly ``default_executor = "fleet"``:
a server that does not use the fleet never imports it.  The configured key is
then hard-matched, so a typo fails at boot with the list of valid keys.
"""

from __future__ import annotations

import importlib

from fleet.engine.dispatcher import Dispatcher
from fleet.executors.inprocess import InProcessExecutor
from fleet.platform.config import Config

DEFAULT_KEY = "default"
FLEET_KEY = "fleet"


def build_dispatcher(config: Config, claimer: str) -> Dispatcher:
    """A Dispatcher with the executors this configuration allows, configured to the default key.

    Raises :class:`fleet.engine.events.ExecutorNotFound` (listing the valid keys)
    when ``config.default_executor`` names no registered executor.
    """
    dispatcher = Dispatcher()
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
    dispatcher.configure(config.default_executor)
    return dispatcher

#!/usr/bin/env python
"""Django's command-line utility for the Cloacina server and agents."""

import os
import sys

# Commands that must never touch (or start) a database: the agent is DB-less.
DB_LESS_COMMANDS = {"runagent"}
# Commands whose event loop is made as Django loads (the "daphne" app creates the server's
# loop while it is imported): uvloop or the standard one is chosen before that.  runagent
# makes its own loop (agents/protocol/event_loop.py: loop_factory).
EVENT_LOOP_COMMANDS = {"serve"}


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cloacina_site.settings")
    if len(sys.argv) > 1 and sys.argv[1] in DB_LESS_COMMANDS:
        os.environ["CLOACINA_DB_LESS"] = "1"
    from django.core.management import execute_from_command_line

    from fleet.platform.config import ConfigError

    try:
        if len(sys.argv) > 1 and sys.argv[1] in EVENT_LOOP_COMMANDS:
            _choose_event_loop()
        execute_from_command_line(sys.argv)
    except ConfigError as exc:  # a bad setting read while loading settings: one line, exit 2
        sys.stderr.write(f"configuration error: {exc}\n")
        sys.exit(2)


def _choose_event_loop() -> None:
    """uvloop unless the configuration (env > config.toml) says ``asyncio``."""
    from agents.protocol.event_loop import EventLoopChoiceError, install_event_loop_policy
    from fleet.platform.config import ConfigError, load_config

    try:
        install_event_loop_policy(load_config().event_loop)
    except EventLoopChoiceError as exc:
        raise ConfigError(str(exc)) from None


if __name__ == "__main__":
    main()

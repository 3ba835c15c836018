#!/usr/bin/env python
"""Django's command-line utility for the Cloacina server and agents."""

import os
import sys

# Commands that must never touch (or start) a database: the agent is DB-less.
DB_LESS_COMMANDS = {"runagent"}


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cloacina_site.settings")
    if len(sys.argv) > 1 and sys.argv[1] in DB_LESS_COMMANDS:
        os.environ["CLOACINA_DB_LESS"] = "1"
    from django.core.management import execute_from_command_line

    from fleet.platform.config import ConfigError

    try:
        execute_from_command_line(sys.argv)
    except ConfigError as exc:  # a bad setting read while loading settings: one line, exit 2
        sys.stderr.write(f"configuration error: {exc}\n")
        sys.exit(2)


if __name__ == "__main__":
    main()

"""`manage.py fleetbench [--agents N] [--tasks N] [--executor default|fleet] [--schedules N]`
`[--simulated-agents N --tenants T]`.

Runs a real server against a database of its own (``cloacina_bench``, flushed
on every run), submits no-op tasks over the REST API and prints throughput and
Ready→started latency percentiles measured from the database rows.  ``--schedules N``
instead makes N cron schedules due in the same second and prints how long the server
took to start them all (fleet/bench/schedules.py).  ``--executor fleet --simulated-agents N
--tenants T`` instead connects N simulated agents over T tenants and prints what the fleet
costs at that scale (fleet/bench/scale.py).
"""

from __future__ import annotations

import importlib
import logging

from django.core.management.base import BaseCommand, CommandError

from fleet.bench.database import use_bench_database
from fleet.bench.default import run_default_bench
from fleet.bench.scale import SWARM_ARGUMENTS, run_scale_bench, scale_settings
from fleet.bench.schedules import run_schedule_bench
from fleet.platform.config import get_config


class Command(BaseCommand):
    help = "Benchmark: throughput and dispatch-latency percentiles, printed as a table."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--executor", choices=["default", "fleet"], default="default")
        parser.add_argument("--tasks", type=int, default=2000, help="tasks in the burst")
        parser.add_argument("--agents", type=int, default=2, help="fleet agents (fleet only)")
        parser.add_argument("--width", type=int, default=10, help="no-op tasks per execution")
        parser.add_argument(
            "--idle-samples", type=int, default=100, help="single tasks timed on an idle server"
        )
        parser.add_argument("--workers", type=int, default=None, help="in-process worker slots")
        parser.add_argument("--poll", type=float, default=1.0, help="scheduler tick seconds")
        parser.add_argument(
            "--paced-rate",
            type=float,
            default=300.0,
            help="tasks/s offered in the paced phase (default executor; 0 skips it)",
        )
        parser.add_argument(
            "--schedules",
            type=int,
            default=0,
            help="instead: N cron schedules due in one second; time until all started",
        )
        for flag, kind, default, text in SWARM_ARGUMENTS:
            parser.add_argument(flag, type=kind, default=default, help=text)

    def handle(self, *args, **options) -> None:
        for name in ("tasks", "width", "agents"):
            if options[name] < 1:
                raise CommandError(f"--{name} must be >= 1, got {options[name]}")
        if options["idle_samples"] < 0:
            raise CommandError("--idle-samples must be >= 0")
        if options["paced_rate"] < 0:
            raise CommandError(f"--paced-rate must be >= 0, got {options['paced_rate']:g}")
        if options["schedules"] < 0:
            raise CommandError(f"--schedules must be >= 0, got {options['schedules']}")
        try:
            swarm_settings = scale_settings(options)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        workers = options["workers"] or get_config().worker_processes
        url = use_bench_database()
        logging.getLogger("httpx").setLevel(logging.WARNING)
        self.stderr.write(f"fleetbench: using database {url.split('?')[0]} (flushed)")
        if options["schedules"]:
            result = run_schedule_bench(url, options["schedules"], workers)
        elif swarm_settings is not None:
            result = run_scale_bench(url, swarm_settings)
        elif options["executor"] == "fleet":
            result = self._fleet(url, options, workers)
        else:
            result = run_default_bench(
                url,
                tasks=options["tasks"],
                width=options["width"],
                idle_samples=options["idle_samples"],
                workers=workers,
                poll_s=options["poll"],
                paced_rate=options["paced_rate"],
            )
        self.stdout.write(result.table())

    def _fleet(self, url: str, options: dict, workers: int):
        try:
            fleet_bench = importlib.import_module("fleet.bench.fleet")
        except ModuleNotFoundError:
            raise CommandError("the fleet benchmark is not available in this build") from None
        return fleet_bench.run_fleet_bench(
            url,
            agents=options["agents"],
            tasks=options["tasks"],
            width=options["width"],
            idle_samples=options["idle_samples"],
            poll_s=options["poll"],
        )

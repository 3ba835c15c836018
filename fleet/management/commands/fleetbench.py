"""`manage.py fleetbench [--agents N] [--tasks N] [--executor default|fleet] [--schedules N]
[--client rest [--clients N] [--rest-poll-interval S]] [--simulated-agents N --tenants T]`.

Runs a real server against a database of its own (``cloacina_bench``, flushed
on every run), submits no-op tasks over the REST API and prints throughput and
Ready→started latency percentiles measured from the database rows.  ``--schedules N``
instead makes N cron schedules due in the same second and prints how long the server
took to start them all (fleet/bench/schedules.py).  ``--replicas N`` runs N fleet servers
on the database with the agents spread over them (fleet/bench/replicas.py).
``--lock-order-tenants T`` instead drives placement and result batches in-process, the
agents and tasks in one tenant and then spread over T, and prints both throughputs and the
deadlocks PostgreSQL detected (fleet/bench/lock_order.py).  ``--client rest`` instead has
users submit one execution at a time over REST and poll it until done, as a script would
(fleet/bench/rest_client.py).
``--executor fleet --simulated-agents N --tenants T`` instead connects N simulated agents
over T tenants and prints what the fleet costs at that scale (fleet/bench/scale.py); with
``--tenant-ratio R`` it instead dispatches with every agent in 1 tenant and then over T, R
rounds, and prints the T-tenant share of the throughput and the deadlocks
(fleet/bench/tenant_ratio.py).  ``--pages N`` instead seeds N agents in one tenant and
times ``GET /api/v1/fleet`` and the console's tenant page over HTTP (fleet/bench/pages.py).
``--pickup-hops N`` instead traces N idle pickups on a fleet of ``--agents`` agents and prints
each hop's share of Ready → ``received`` (fleet/bench/pickup_hops.py).
"""

from __future__ import annotations

import importlib
import logging

from django.core.management.base import BaseCommand, CommandError

from fleet.bench import rest_client
from fleet.bench.database import use_bench_database
from fleet.bench.default import run_default_bench
from fleet.bench.lock_order import run_lock_order_bench
from fleet.bench.pages import run_pages_bench
from fleet.bench.pickup_hops import run_pickup_hops_bench
from fleet.bench.replicas import run_replicas_bench
from fleet.bench.scale import SWARM_ARGUMENTS, run_scale_bench, scale_settings
from fleet.bench.schedules import run_schedule_bench
from fleet.bench.tenant_ratio import run_tenant_ratio_bench
from fleet.platform.config import get_config
from fleet.platform.embedded_db import redacted_url


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
            "--replicas",
            type=int,
            default=0,
            help="instead: N fleet servers on the database, the agents spread over them",
        )
        parser.add_argument(
            "--lock-order-tenants",
            type=int,
            default=0,
            help="instead: placement and result batches in-process, --agents and --tasks "
            "in 1 tenant, then over T tenants (fleet/bench/lock_order.py)",
        )
        parser.add_argument(
            "--client",
            choices=["rest"],
            default=None,
            help="instead: users submit one execution at a time over REST and poll it until done "
            "(--tasks / --width executions; fleet/bench/rest_client.py)",
        )
        parser.add_argument("--clients", type=int, default=1, help="parallel users (--client rest)")
        parser.add_argument(
            "--rest-poll-interval",
            type=float,
            default=0.01,
            help="seconds between a user's GETs of its execution (--client rest)",
        )
        parser.add_argument(
            "--schedules",
            type=int,
            default=0,
            help="instead: N cron schedules due in one second; time until all started",
        )
        for flag, kind, default, text in SWARM_ARGUMENTS:
            parser.add_argument(flag, type=kind, default=default, help=text)
        parser.add_argument(
            "--pages",
            type=int,
            default=0,
            metavar="AGENTS",
            help="instead: AGENTS agents in one tenant; p50/p95 of GET /api/v1/fleet and the "
            "console's tenant page over HTTP (fleet/bench/pages.py)",
        )
        parser.add_argument(
            "--page-requests", type=int, default=50, help="timed requests per page (--pages)"
        )
        parser.add_argument(
            "--pickup-hops",
            type=int,
            default=0,
            metavar="SAMPLES",
            help="instead: SAMPLES idle pickups on a traced fleet of --agents agents; each hop's "
            "p50/p90/p99 from Ready to `received` (fleet/bench/pickup_hops.py)",
        )
        parser.add_argument(
            "--tenant-ratio",
            type=int,
            default=0,
            metavar="ROUNDS",
            help="instead (with --simulated-agents and --tenants T > 1): the dispatch with every "
            "agent in 1 tenant, then over T, ROUNDS rounds (fleet/bench/tenant_ratio.py)",
        )

    def handle(self, *args, **options) -> None:
        for name in ("tasks", "width", "agents"):
            if options[name] < 1:
                raise CommandError(f"--{name} must be >= 1, got {options[name]}")
        if options["idle_samples"] < 0:
            raise CommandError("--idle-samples must be >= 0")
        if options["paced_rate"] < 0:
            raise CommandError(f"--paced-rate must be >= 0, got {options['paced_rate']:g}")
        if options["lock_order_tenants"] < 0:
            raise CommandError(
                f"--lock-order-tenants must be >= 0, got {options['lock_order_tenants']}"
            )
        if options["schedules"] < 0:
            raise CommandError(f"--schedules must be >= 0, got {options['schedules']}")
        if options["replicas"] < 0:
            raise CommandError(f"--replicas must be >= 0, got {options['replicas']}")
        if options["client"]:
            executions = max(1, options["tasks"] // options["width"])
            errors = rest_client.option_errors(
                executions, options["clients"], options["rest_poll_interval"]
            )
            if errors:
                raise CommandError("; ".join(errors))
        try:
            swarm_settings = scale_settings(options)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        if options["pages"] < 0 or options["page_requests"] < 1:
            raise CommandError(
                f"--pages must be >= 0 and --page-requests >= 1, got {options['pages']} and "
                f"{options['page_requests']}"
            )
        if options["tenant_ratio"] < 0:
            raise CommandError(f"--tenant-ratio must be >= 0, got {options['tenant_ratio']}")
        if options["tenant_ratio"] and (swarm_settings is None or swarm_settings.tenants < 2):
            raise CommandError("--tenant-ratio needs --simulated-agents N and --tenants T >= 2")
        workers = options["workers"] or get_config().worker_processes
        url = use_bench_database()
        logging.getLogger("httpx").setLevel(logging.WARNING)
        self.stderr.write(f"fleetbench: using database {redacted_url(url)} (flushed)")
        if options["lock_order_tenants"]:
            result = run_lock_order_bench(
                options["lock_order_tenants"], options["agents"], options["tasks"], options["width"]
            )
        elif options["pages"]:
            result = run_pages_bench(url, options["pages"], options["page_requests"])
        elif options["pickup_hops"]:
            result = run_pickup_hops_bench(
                url, options["pickup_hops"], options["agents"], options["poll"]
            )
        elif options["schedules"]:
            result = run_schedule_bench(url, options["schedules"], workers)
        elif options["replicas"]:
            result = run_replicas_bench(
                url, options["replicas"], options["agents"], options["tasks"],
                options["width"], options["poll"],
            )  # fmt: skip
        elif options["client"] == "rest":
            result = rest_client.run_rest_client_bench(
                url,
                options["executor"],
                tasks=options["tasks"],
                width=options["width"],
                clients=options["clients"],
                poll_interval_s=options["rest_poll_interval"],
                agents=options["agents"],
                workers=workers,
                poll_s=options["poll"],
            )
        elif swarm_settings is not None and options["tenant_ratio"]:
            result = run_tenant_ratio_bench(
                url, swarm_settings, options["tenant_ratio"], self.stderr.write
            )
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

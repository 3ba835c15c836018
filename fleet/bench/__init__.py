"""`fleetbench`: throughput and dispatch latency of a real server, on a database of its own.

Modules: ``database`` (the ``cloacina_bench`` database), ``server`` (a `serve`
subprocess and its HTTP API), ``workload`` (no-op packages, submission,
measurement, the table), ``default`` (the in-process executor run) and
``fleet`` (the fleet run, provided with the fleet executor).
"""

"""Executor-internal routing: which agent runs a task (docs/routing.md).

The scheduler and the dispatcher know nothing of it: the fleet executor's placement
asks :mod:`fleet.executors.fleet.routing.selection` for an agent, within the tenant, liveness and
target-triple filters, and reserves its slot in the same statement.
"""

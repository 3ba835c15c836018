"""The executors: where a Ready task runs.

``inprocess`` (key ``default``) runs it on the server itself; ``fleet`` places it on an
execution agent (its parts: fleet/delivery for placement, outbox, relay and liveness,
fleet/routing for choosing the agent).  Both plug into the engine (fleet/engine) through
its TaskExecutor interface and the hooks it exposes; the engine imports none of them.
``registry.build_dispatcher`` composes the configured one.
"""

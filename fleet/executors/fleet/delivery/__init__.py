"""The delivery path to agents: the durable ``delivery_outbox``, the per-process relay
that pushes it over WebSockets, and the sweeps that keep it honest (redelivery,
liveness + reclaim, pruning).  See docs/fleet.md."""

"""The fleet executor: placement, outbox, relay, liveness and routing over the agents."""

from django.apps import AppConfig


class FleetConfig(AppConfig):
    name = "fleet"
    verbose_name = "Fleet"

    def ready(self) -> None:
        # The fleet executor's side of an outcome (ack the packet, free the agent's slot)
        # is a hook it registers with the engine (fleet/engine/hooks.py).  Every server
        # process may receive a fleet outcome (the agents' result endpoint), so it is
        # registered at startup, in every process, whatever the default executor.
        # A local import: outbox_ack imports models, which only exist once the app
        # registry is ready, i.e. here, not when Django imports this apps module.
        from fleet.executors.fleet.delivery import outbox_ack

        outbox_ack.register()

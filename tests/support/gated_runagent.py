#!/usr/bin/env python
"""``manage.py runagent`` with two test gates, to put a real agent process through an exact
interleaving (tests/e2e/test_fleet_reregistration_e2e.py).  Run as
``python tests/support/gated_runagent.py runagent --server … ``.

``$CLOACINA_TEST_GATES`` names a directory; while a file exists there:

* ``results``: every outcome waits before it is reported, over the socket or REST (the
  agent holds finished outcomes, as when its server is away);
* ``work``: a work packet pushed to any registration after the first waits before the
  agent looks at it (pushed, but not yet seen);
* ``answers``: the server's answer to an outcome posted over REST waits before the agent
  acts on it (recorded by the server, not yet known to the agent);
* ``refuse``: every new work packet is refused (outcome ``refused``, through the agent's
  own refusal path), as an agent that cannot run anything would
  (tests/e2e/test_breaker_e2e.py: its circuit breaker opens).

``CLOACINA_TEST_NO_INSTANCE_ID=1`` registers without an instance id, as an agent of an
earlier version does.  Everything else is the real agent.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

GATE_POLL_S = 0.05


async def _wait_gate(name: str) -> None:
    gate = Path(os.environ["CLOACINA_TEST_GATES"]) / name
    while gate.exists():
        await asyncio.sleep(GATE_POLL_S)


def _install_gates() -> None:
    from agents.runtime import agent as agent_module
    from agents.runtime.outcome_reporter import OutcomeReporter

    deliver = OutcomeReporter._deliver

    async def gated_deliver(self, held, loop):
        await _wait_gate("results")
        return await deliver(self, held, loop)

    OutcomeReporter._deliver = gated_deliver

    from agents.runtime.client import AgentClient  # local: after sys.path has the repo

    post_result = AgentClient.post_result

    async def gated_post_result(self, agent_id, body):
        answer = await post_result(self, agent_id, body)
        await _wait_gate("answers")
        return answer

    AgentClient.post_result = gated_post_result

    on_frame = agent_module.Agent._on_frame
    first: list[str] = []

    def gated_on_frame(self, frame, agent_id):  # synchronous, as the agent's own
        first[:] = first or [agent_id]  # the first registration's agent id
        if frame.get("type") != "work" or agent_id == first[0]:
            return on_frame(self, frame, agent_id)

        async def later() -> None:  # the session goes on reading frames meanwhile
            await _wait_gate("work")
            on_frame(self, frame, agent_id)

        task = asyncio.create_task(later())
        self._gated = [*getattr(self, "_gated", []), task]  # keep a reference

    agent_module.Agent._on_frame = gated_on_frame

    from agents.runtime import work_intake

    mismatch = work_intake.triple_mismatch

    def refusing(packet, target_triple):
        if (Path(os.environ["CLOACINA_TEST_GATES"]) / "refuse").exists():
            return "refused by the test gate"
        return mismatch(packet, target_triple)

    work_intake.triple_mismatch = refusing

    if os.environ.get("CLOACINA_TEST_NO_INSTANCE_ID") == "1":
        body = agent_module.Agent._registration_body

        def without_instance_id(self, wire_format):
            return {k: v for k, v in body(self, wire_format).items() if k != "instance_id"}

        agent_module.Agent._registration_body = without_instance_id


def main() -> None:
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "cloacina_site.settings")
    os.environ["CLOACINA_DB_LESS"] = "1"
    _install_gates()
    from django.core.management import execute_from_command_line

    execute_from_command_line([str(REPO / "manage.py"), *sys.argv[1:]])


if __name__ == "__main__":
    main()

"""What the test layers share (tests/unit, tests/integration, tests/e2e).

- processes: real `serve`, `runagent` (``start_agent``, the one launcher, gated or not),
  the CLI, and the control plane's environment;
- agents: ``make_agent``, the one factory for agent rows, and reading the roster back;
- keys: API keys minted through the ORM or the real CLI, ``bearer`` headers;
- waiting: ``wait_until`` (and its asyncio twin ``until``), the one polling loop;
- tenancy: the tenant and key fixtures the database layers register;
- factories, workloads, packages, slow_index: packages, executions and archives;
- server_api, sockets, outcomes: talking to a server over HTTP, a socket, a result;
- fakes: HTTP-boundary fakes (Docker Engine, Kubernetes API, a server for the agent);
- tls, console, browser, hostile, chaos, routing, inprocess, loop: one suite's helpers each;
- gated_runagent: `runagent` with test gates, run as a subprocess by its path.
"""

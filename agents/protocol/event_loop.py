"""Which asyncio event loop the server and the agents run: uvloop where it imports.

Every task crosses several event-loop wake-ups on the server and on its agent (the pickup
hops of docs/performance.md), and the burst and the drain are CPU-bound, so the loop's own
machinery (its selector, its handles and timers, ``call_soon_threadsafe``) is paid per
task.  uvloop (libuv, written in Cython) does that machinery in C.

``CLOACINA_EVENT_LOOP`` chooses: ``uvloop`` (the default) or ``asyncio`` (the standard
library's loop, the fall-back).  Where uvloop cannot be imported (a platform it does not
build on) the standard loop runs whatever the setting says.  The choice is made by
installing an event loop *policy* for ``serve``, because daphne creates the server's loop
itself, with ``asyncio.new_event_loop()``, when ``daphne.server`` is imported (by the
``daphne`` app, as Django loads): manage.py installs it first.  ``runagent`` makes its own
loop and passes :func:`loop_factory` to ``asyncio.Runner``, leaving the process's policy
alone.  Both use this, so it lives with the Django-free libraries the two share.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from types import ModuleType

ENV_EVENT_LOOP = "CLOACINA_EVENT_LOOP"
UVLOOP = "uvloop"
STANDARD = "asyncio"
CHOICES = (UVLOOP, STANDARD)
DEFAULT = UVLOOP


class EventLoopChoiceError(ValueError):
    """``CLOACINA_EVENT_LOOP`` names no loop this process knows."""


def parse_choice(raw: str | None) -> str:
    """The loop a setting asks for (unset or empty: the default)."""
    value = (raw or "").strip().lower() or DEFAULT
    if value not in CHOICES:
        raise EventLoopChoiceError(
            f"{ENV_EVENT_LOOP} must be one of {', '.join(CHOICES)}, got {raw!r}"
        )
    return value


def install_event_loop_policy(choice: str | None = None) -> str:
    """Make every new event loop of this process the chosen kind; return the kind now in
    use (``asyncio`` when uvloop was asked for but cannot be imported).

    ``choice`` defaults to ``$CLOACINA_EVENT_LOOP``.  Call before any loop is created.
    For ``serve``, whose loop daphne creates; a process that makes its own loop should
    pass :func:`loop_factory` to ``asyncio.Runner`` instead (no process-wide state).
    """
    uvloop = _uvloop_if_wanted(choice)
    if uvloop is None:
        asyncio.set_event_loop_policy(None)  # the standard library's default policy
        return STANDARD
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return UVLOOP


def loop_factory(choice: str | None = None) -> Callable[[], asyncio.AbstractEventLoop]:
    """The function that makes the chosen kind of loop (``asyncio.Runner(loop_factory=…)``);
    ``choice`` defaults to ``$CLOACINA_EVENT_LOOP``."""
    uvloop = _uvloop_if_wanted(choice)
    return asyncio.new_event_loop if uvloop is None else uvloop.new_event_loop


def _uvloop_if_wanted(choice: str | None) -> ModuleType | None:
    """The uvloop module when it is chosen and importable, else None (the standard loop)."""
    wanted = parse_choice(os.environ.get(ENV_EVENT_LOOP) if choice is None else choice)
    if wanted == STANDARD:
        return None
    try:
        import uvloop
    except ImportError:  # no wheel for this platform: the standard loop does the same work
        return None
    return uvloop


def running_loop_kind(loop: asyncio.AbstractEventLoop) -> str:
    """``uvloop`` or ``asyncio``: what a running loop is (for the ready line and logs)."""
    return UVLOOP if type(loop).__module__.startswith("uvloop") else STANDARD

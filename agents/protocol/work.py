"""A work packet as the agent sees it, and the outcome body it posts back.

Pure data and checks: no I/O, so each rule (what a valid packet is, when the
agent refuses one, how a run becomes an outcome) is tested on its own.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

OUTCOME_SUCCESS = "success"
OUTCOME_FAILURE = "failure"
OUTCOME_REFUSED = "refused"

_DIGEST = re.compile(r"^[0-9a-f]{64}$")
# The form the server writes a UUID in (str(uuid.UUID)): taken without building a UUID.
_CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")

# field -> accepted types (bool is an int in Python; it is never a valid id or timeout).
_REQUIRED: dict[str, tuple[type, ...]] = {
    "outbox_id": (int,),
    "task_execution_id": (str,),
    "assignment": (int,),
    "function": (str,),
    "context_json": (str,),
    "artifact_digest": (str,),
    "target_triple": (str,),
    "timeout_s": (int, float),
}

TaskKey = tuple[str, int]


class PacketError(ValueError):
    """The packet is unusable; ``ids`` is set when it still names a task we can refuse."""

    def __init__(self, message: str, ids: tuple[int, str, int] | None = None) -> None:
        super().__init__(message)
        self.ids = ids


@dataclass(frozen=True)
class WorkPacket:
    outbox_id: int
    task_execution_id: str
    assignment: int
    function: str
    context_json: str
    artifact_digest: str
    target_triple: str
    timeout_s: float
    task_name: str = ""
    attempt: int = 1
    workflow_execution_id: str = ""
    package_kind: str = ""
    tenant: str = ""
    # A context too large for a frame comes by reference ({"bytes", "sha256"}): the agent
    # fetches it before the run (agents/runtime/context_fetch.py); context_json is then "".
    context_ref: dict[str, Any] | None = None

    @property
    def key(self) -> TaskKey:
        return (self.task_execution_id, self.assignment)

    def describe(self) -> str:
        return (
            f"{self.task_name or self.function} (task {self.task_execution_id} #{self.assignment})"
        )


def _is_uuid(value: object) -> bool:
    if type(value) is str and _CANONICAL_UUID.fullmatch(value):
        return True  # once per packet: a regex is a fraction of uuid.UUID()
    try:
        uuid.UUID(str(value))
    except ValueError:
        return False
    return isinstance(value, str)


def _ids(raw: dict[str, Any]) -> tuple[int, str, int] | None:
    """The ids a refusal must name, if the packet carries them well-formed (else None)."""
    outbox_id, teid, assignment = (
        raw.get(k) for k in ("outbox_id", "task_execution_id", "assignment")
    )
    ok = (
        isinstance(outbox_id, int)
        and not isinstance(outbox_id, bool)
        and _is_uuid(teid)
        and isinstance(assignment, int)
        and not isinstance(assignment, bool)
    )
    return (outbox_id, teid, assignment) if ok else None


def parse_packet(raw: object) -> WorkPacket:
    """Validate a ``work`` frame's ``packet``; raises :class:`PacketError` naming the problem."""
    if not isinstance(raw, dict):
        raise PacketError("work packet is not an object")
    ids = _ids(raw)
    context_ref = raw.get("context_ref")
    if context_ref is not None:
        if not _valid_ref(context_ref):
            raise PacketError(
                "malformed work packet: context_ref must be {bytes: integer, sha256: hex digest}",
                ids,
            )
        raw = {**raw, "context_json": raw.get("context_json", "")}
    for name, kinds in _REQUIRED.items():
        value = raw.get(name)
        if value is None:
            raise PacketError(f"malformed work packet: missing {name}", ids)
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise PacketError(f"malformed work packet: {name} has the wrong type", ids)
    if ids is None:
        # Without well-formed ids there is no task to refuse, and a bogus id in our
        # heartbeats would get the socket closed as malformed: drop it (logged).
        raise PacketError("malformed work packet: bad outbox_id, task_execution_id or assignment")
    if not _DIGEST.match(raw["artifact_digest"]):
        raise PacketError("malformed work packet: artifact_digest is not a sha256 hex digest", ids)
    if raw["timeout_s"] <= 0:
        raise PacketError("malformed work packet: timeout_s must be positive", ids)
    attempt = raw.get("attempt", 1)
    return WorkPacket(
        outbox_id=raw["outbox_id"],
        task_execution_id=raw["task_execution_id"],
        assignment=raw["assignment"],
        function=raw["function"],
        context_json=raw["context_json"],
        artifact_digest=raw["artifact_digest"],
        target_triple=raw["target_triple"],
        timeout_s=float(raw["timeout_s"]),
        task_name=str(raw.get("task_name") or ""),
        attempt=attempt if isinstance(attempt, int) else 1,
        workflow_execution_id=str(raw.get("workflow_execution_id") or ""),
        package_kind=str(raw.get("package_kind") or ""),
        tenant=str(raw.get("tenant") or ""),
        context_ref=context_ref,
    )


def _valid_ref(ref: object) -> bool:
    if not isinstance(ref, dict):
        return False
    size, digest = ref.get("bytes"), ref.get("sha256")
    return (
        isinstance(size, int)
        and not isinstance(size, bool)
        and size >= 0
        and isinstance(digest, str)
        and bool(_DIGEST.match(digest))
    )


def triple_mismatch(packet: WorkPacket, own_triple: str) -> str | None:
    """The refusal reason when the artifact was built for another target, else None.

    Fail closed: the server should never send such a packet, but the agent does not
    rely on that, whatever the package kind.
    """
    if packet.target_triple == own_triple:
        return None
    return (
        f"target triple mismatch: the packet's artifact is for {packet.target_triple}, "
        f"this agent is {own_triple}"
    )


def result_body(
    packet: WorkPacket,
    outcome: str,
    output: dict[str, Any] | None = None,
    error_type: str = "",
    error_message: str = "",
    traceback: str = "",
    log: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The body of ``POST /agents/{id}/results``; ``log``: what the run printed
    (``{text, bytes, truncated_bytes}``), when it ran."""
    body = {
        "outbox_id": packet.outbox_id,
        "task_execution_id": packet.task_execution_id,
        "assignment": packet.assignment,
        "outcome": outcome,
        "output": output,
        "error_type": error_type,
        "error_message": error_message,
        "traceback": traceback,
    }
    if log is not None:
        body["log"] = log
    return body


def refusal(packet: WorkPacket, reason: str) -> dict[str, Any]:
    return result_body(packet, OUTCOME_REFUSED, error_type="Refused", error_message=reason)


def refusal_for_ids(ids: tuple[int, str, int], reason: str) -> dict[str, Any]:
    """A refusal for a packet too malformed to parse, built from the ids it did carry."""
    outbox_id, teid, assignment = ids
    return {
        "outbox_id": outbox_id,
        "task_execution_id": teid,
        "assignment": assignment,
        "outcome": OUTCOME_REFUSED,
        "output": None,
        "error_type": "Refused",
        "error_message": reason,
        "traceback": "",
    }


def run_result(packet: WorkPacket, run: Any) -> dict[str, Any]:
    """Turn a task_runner.RunOutcome into the outcome body (a timeout is a failure)."""
    # A silent run sends no log at all: the commonest outcome stays as small as before.
    printed = getattr(run, "log", None)
    log = printed.as_body() if printed is not None and printed.bytes > 0 else None
    if run.status == "success":
        return result_body(packet, OUTCOME_SUCCESS, output=run.output or {}, log=log)
    return result_body(
        packet,
        OUTCOME_FAILURE,
        error_type=run.error_type or ("TaskTimeout" if run.status == "timeout" else "Error"),
        error_message=run.error_message,
        traceback=run.traceback,
        log=log,
    )

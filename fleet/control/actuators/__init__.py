"""Actuators: none (no-op), process (local runagent children), docker, kubernetes."""

from fleet.control.actuators.base import Actuator, AgentHandle, ReconcileResult

__all__ = ["Actuator", "AgentHandle", "ReconcileResult"]

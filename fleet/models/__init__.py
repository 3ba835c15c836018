from fleet.models.control import AutoscaleDecision, ChangeReason, FleetChange, OutboxDepthSample
from fleet.models.delivery import DeliveryOutbox, Eviction, OutboxState
from fleet.models.executions import (
    TASK_TERMINAL,
    WORKFLOW_TERMINAL,
    Outcome,
    TaskExecution,
    TaskOutcome,
    TaskStatus,
    TriggerRule,
    WorkflowExecution,
    WorkflowStatus,
)
from fleet.models.pools import DEFAULT_POOL, AgentPool
from fleet.models.reruns import ExecutionLink, RerunKind
from fleet.models.routing import AffinityBinding, AgentEventCount, BindingKind
from fleet.models.schedules import (
    Catchup,
    FireOutcome,
    Overlap,
    Schedule,
    ScheduleFire,
    ScheduleSource,
)
from fleet.models.servers import Installation, ServerInstance
from fleet.platform.tenancy import ApiKey, Role, Tenant, TenantMembership

__all__ = [
    "AffinityBinding",
    "AgentPool",
    "DEFAULT_POOL",
    "AgentEventCount",
    "BindingKind",
    "Installation",
    "Catchup",
    "FireOutcome",
    "Overlap",
    "Schedule",
    "ScheduleFire",
    "ScheduleSource",
    "ApiKey",
    "AutoscaleDecision",
    "ChangeReason",
    "DeliveryOutbox",
    "Eviction",
    "ExecutionLink",
    "FleetChange",
    "OutboxDepthSample",
    "OutboxState",
    "Outcome",
    "RerunKind",
    "Role",
    "ServerInstance",
    "TASK_TERMINAL",
    "TaskExecution",
    "TaskOutcome",
    "TaskStatus",
    "Tenant",
    "TenantMembership",
    "TriggerRule",
    "WORKFLOW_TERMINAL",
    "WorkflowExecution",
    "WorkflowStatus",
]

"""The one NinjaAPI; each app contributes Routers from its api modules."""

from ninja import NinjaAPI

from agents.api import router as agents_router
from artifacts.api import router as artifacts_router
from fleet.api.executions import router as executions_router
from fleet.api.fleet_status import router as fleet_router

api = NinjaAPI(
    title="Cloacina",
    version="1",
    urls_namespace="api-v1",
    description="Workflow server and execution-agent fleet. Authenticate with `Authorization: Bearer <key>`.",
)
api.add_router("/", artifacts_router, tags=["packages"])
api.add_router("/", executions_router, tags=["executions"])
api.add_router("/", fleet_router, tags=["fleet"])
api.add_router("/", agents_router, tags=["agents"])

"""The one NinjaAPI; each app contributes a Router from its api.py."""

from ninja import NinjaAPI

from agents.api import router as agents_router
from artifacts.api import router as artifacts_router
from fleet.api import router as fleet_router

api = NinjaAPI(
    title="Cloacina",
    version="1",
    urls_namespace="api-v1",
    description="Workflow server and execution-agent fleet. Authenticate with `Authorization: Bearer <key>`.",
)
api.add_router("/", artifacts_router)
api.add_router("/", fleet_router)
api.add_router("/", agents_router)

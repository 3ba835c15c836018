"""The one NinjaAPI; each app contributes Routers from its api modules."""

from ninja import NinjaAPI

from agents.surface.api import router as agents_router
from artifacts.surface.api import router as artifacts_router
from fleet.api.contract import (
    ObjectBodyParser,
    document_shared_contract,
    install_error_handlers,
    operation_roles,
)
from fleet.api.executions import router as executions_router
from fleet.api.fleet_status import router as fleet_router
from fleet.api.pools import router as pools_router
from fleet.api.reruns import router as reruns_router
from fleet.api.schedules import router as schedules_router


class CloacinaAPI(NinjaAPI):
    """Publishes the errors and roles every operation shares (see api_contract)."""

    def get_openapi_schema(self, *, path_prefix=None, path_params=None):
        schema = super().get_openapi_schema(path_prefix=path_prefix, path_params=path_params)
        return document_shared_contract(schema, operation_roles(self))


api = CloacinaAPI(
    title="Cloacina",
    version="1",
    urls_namespace="api-v1",
    parser=ObjectBodyParser(),
    description="Workflow server and execution-agent fleet. Authenticate with `Authorization: Bearer <key>`.",
)
install_error_handlers(api)
api.add_router("/", artifacts_router, tags=["packages"])
api.add_router("/", executions_router, tags=["executions"])
api.add_router("/", reruns_router, tags=["executions"])
api.add_router("/", fleet_router, tags=["fleet"])
api.add_router("/", pools_router, tags=["fleet"])
api.add_router("/", schedules_router, tags=["schedules"])
api.add_router("/", agents_router, tags=["agents"])

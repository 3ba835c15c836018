from django.urls import path

from fleet.console import (
    agents,
    auth,
    evictions,
    executions,
    outbox,
    overview,
    packages,
    pools,
    reruns,
    schedules,
    tenants,
)

app_name = "console"
urlpatterns = [
    path("", overview.overview, name="overview"),
    path("partials/overview/", overview.overview_rows, name="overview_rows"),
    path("login/", auth.login, name="login"),
    path("logout/", auth.logout, name="logout"),
    path("tenants/<str:name>/", tenants.tenant_page, name="tenant"),
    path("tenants/<str:name>/partials/<slug:part>/", tenants.tenant_partial, name="tenant_partial"),
    path("tenants/<str:name>/provision/", tenants.provision, name="provision"),
    path("tenants/<str:name>/deprovision/", tenants.deprovision, name="deprovision"),
    path("tenants/<str:name>/fleet-overrides/", tenants.fleet_overrides, name="fleet_overrides"),
    path(
        "tenants/<str:name>/agents/<uuid:agent_id>/drain/", agents.drain_agent, name="drain_agent"
    ),
    path("tenants/<str:name>/pools/", pools.create_pool, name="create_pool"),
    path(
        "tenants/<str:name>/pools/<slug:pool>/provision/",
        pools.provision_pool,
        name="provision_pool",
    ),
    path(
        "tenants/<str:name>/pools/<slug:pool>/deprovision/",
        pools.deprovision_pool,
        name="deprovision_pool",
    ),
    path("tenants/<str:name>/pools/<slug:pool>/edit/", pools.edit_pool, name="edit_pool"),
    path("tenants/<str:name>/pools/<slug:pool>/delete/", pools.delete_pool, name="delete_pool"),
    path("tenants/<str:name>/packages/", packages.packages, name="packages"),
    path(
        "tenants/<str:name>/packages/partials/table/",
        packages.packages_table,
        name="packages_table",
    ),
    path("tenants/<str:name>/packages/upload/", packages.upload, name="upload_package"),
    path(
        "tenants/<str:name>/executions/start/",
        packages.start_execution,
        name="start_execution",
    ),
    path("tenants/<str:name>/schedules/", schedules.schedules, name="schedules"),
    path(
        "tenants/<str:name>/schedules/partials/table/",
        schedules.schedules_table,
        name="schedules_table",
    ),
    path(
        "tenants/<str:name>/schedules/<uuid:schedule_id>/pause/",
        schedules.pause,
        name="pause_schedule",
    ),
    path(
        "tenants/<str:name>/schedules/<uuid:schedule_id>/resume/",
        schedules.resume,
        name="resume_schedule",
    ),
    path(
        "tenants/<str:name>/schedules/<uuid:schedule_id>/run/",
        schedules.run_now,
        name="run_schedule",
    ),
    path("evictions/", evictions.evictions, name="evictions"),
    path("evictions/partials/table/", evictions.evictions_table, name="evictions_table"),
    path("outbox/", outbox.outbox, name="outbox"),
    path("outbox/partials/depth/", outbox.outbox_depth, name="outbox_depth"),
    path("executions/", executions.executions, name="executions"),
    path("executions/partials/table/", executions.executions_table, name="executions_table"),
    path("executions/<uuid:execution_id>/", executions.execution_detail, name="execution"),
    path(
        "executions/<uuid:execution_id>/partials/graph/",
        executions.execution_graph,
        name="execution_graph",
    ),
    path("executions/<uuid:execution_id>/cancel/", executions.cancel, name="cancel_execution"),
    path("executions/<uuid:execution_id>/rerun/", reruns.rerun, name="rerun_execution"),
    path("executions/<uuid:execution_id>/retry/", reruns.retry, name="retry_execution"),
]

from django.contrib import admin
from django.urls import include, path

from cloacina_site.api import api
from cloacina_site.health import healthz
from fleet.metrics import metrics_view

urlpatterns = [
    path("api/v1/", api.urls),
    path("healthz", healthz, name="healthz"),
    path("metrics", metrics_view, name="metrics"),
    path("admin/", admin.site.urls),
    path("console/", include("fleet.console.urls")),
]

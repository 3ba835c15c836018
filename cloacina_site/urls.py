from django.contrib import admin
from django.urls import include, path, re_path

from cloacina_site.api import api
from cloacina_site.static_files import static_file
from fleet.api.health import healthz
from fleet.api.metrics import metrics_view

handler400 = "cloacina_site.web_security.bad_request"

urlpatterns = [
    path("api/v1/", api.urls),
    path("healthz", healthz, name="healthz"),
    path("metrics", metrics_view, name="metrics"),
    path("admin/", admin.site.urls),
    path("console/", include("fleet.console.urls")),
    re_path(r"^static/(?P<path>.+)$", static_file, name="static"),
]

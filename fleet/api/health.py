"""/healthz: 200 once the database answers."""

from django.db import connection
from django.http import HttpRequest, JsonResponse


def healthz(request: HttpRequest) -> JsonResponse:
    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT 1")
    except Exception as exc:  # any database failure means unhealthy
        return JsonResponse(
            {"status": "unavailable", "detail": f"database unreachable: {exc.__class__.__name__}"},
            status=503,
        )
    return JsonResponse({"status": "ok"})

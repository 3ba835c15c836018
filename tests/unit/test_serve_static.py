"""Static files are served by the app itself (`serve` has no web server in front)."""

from __future__ import annotations

import pytest
from django.test import Client

from cloacina_site.static_files import static_file


@pytest.mark.parametrize(
    "path, content_type",
    [("/static/htmx.min.js", "text/javascript"), ("/static/admin/css/base.css", "text/css")],
)
def test_it_serves_project_and_app_static_files(path, content_type):
    response = Client().get(path)
    assert response.status_code == 200
    assert response["Content-Type"].startswith(content_type)
    assert b"".join(response.streaming_content)


@pytest.mark.parametrize(
    "path", ["nope.js", "../cloacina_site/settings.py", "/etc/passwd", "a/../../x"]
)
def test_it_refuses_missing_files_and_traversal(rf, path):
    from django.http import Http404

    with pytest.raises(Http404):
        static_file(rf.get("/static/x"), path)

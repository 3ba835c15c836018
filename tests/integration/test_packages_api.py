"""The package REST endpoints: upload, list, per-target builds, download, roles and tenancy."""

from __future__ import annotations

import hashlib
import io
import random
import re
import zipfile

import pytest
from django.core.files.uploadedfile import SimpleUploadedFile
from django.test import Client

from agents.protocol.triples import host_triple
from agents.sandbox import archive
from artifacts.models import ArtifactBlob, PackageArtifact, WorkflowPackage
from artifacts.store.queries import active_package
from artifacts.store.storage import load_blob
from artifacts.store.testing import (
    build_archive,
    example_archive,
    package_files,
)
from tests.support.keys import bearer
from tests.support.packages import (
    ARM,
    BAD_UPLOADS,
    bad_tar,
    native,
    upload,
    upload_target,
    with_valid,
)

pytestmark = pytest.mark.django_db


@pytest.fixture
def client() -> Client:
    return Client()


def assert_nothing_stored():
    assert WorkflowPackage.objects.count() == 0
    assert PackageArtifact.objects.count() == 0
    assert ArtifactBlob.objects.count() == 0


# --- upload -------------------------------------------------------------------------


def test_it_uploads_the_example(client, write_key, tenant):
    data = example_archive()
    response = upload(client, write_key, data)
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["name"] == "etl-demo" and body["version"] == "1.0.0" and body["kind"] == "python"
    assert body["workflow"] == "etl"
    assert body["tasks"] == ["extract", "transform_a", "transform_b", "load"]
    assert body["superseded"] is False and body["host_triple"] == host_triple()
    package = WorkflowPackage.objects.get(tenant=tenant)
    assert package.digest == body["digest"]
    assert package.manifest["tasks"][0]["retries"] == 2
    stored = load_blob(body["digest"])
    assert hashlib.sha256(stored).hexdigest() == body["digest"] == package.digest
    assert archive.read_members(stored)["cloacina.toml"].startswith(b"#")
    assert active_package(tenant, "etl") == package


def test_a_zip_of_the_same_files_is_the_same_package(client, write_key):
    first = upload(client, write_key, example_archive())
    again = upload(client, write_key, example_archive(fmt="zip"))
    assert first.status_code == 201 and again.status_code == 200
    assert again.json()["digest"] == first.json()["digest"]
    assert WorkflowPackage.objects.count() == 1 and ArtifactBlob.objects.count() == 1


def test_same_version_with_different_content_is_a_conflict(client, write_key):
    assert upload(client, write_key, build_archive(package_files())).status_code == 201
    changed = package_files(source="def a(c):\n    return {}\n\ndef b(c):\n    return {'x': 1}\n")
    response = upload(client, write_key, build_archive(changed))
    assert response.status_code == 409
    assert "demo" in response.json()["detail"] and "1.0.0" in response.json()["detail"]
    # "1.0" is the same PEP 440 version as "1.0.0".
    response = upload(
        client,
        write_key,
        build_archive(
            package_files(version="1.0", source="#\n" + "def a(c): pass\ndef b(c): pass\n")
        ),
    )
    assert response.status_code == 409
    assert WorkflowPackage.objects.count() == 1 and ArtifactBlob.objects.count() == 1


def test_a_newer_version_supersedes_older_ones(client, write_key, tenant):
    for version in ("1.0.0", "1.10.0", "1.2.0"):  # 1.2.0 arrives last but is older than 1.10.0
        response = upload(client, write_key, build_archive(package_files(version=version)))
        assert response.status_code == 201
    assert response.json()["superseded"] is True
    states = dict(WorkflowPackage.objects.values_list("version", "superseded"))
    assert states == {"1.0.0": True, "1.10.0": False, "1.2.0": True}
    assert active_package(tenant, "demo").version == "1.10.0"
    assert active_package(tenant, "nope") is None


def test_supersede_stays_within_one_package_name_and_tenant(
    client, write_key, other_write_key, tenant, other_tenant
):
    upload(client, write_key, build_archive(package_files(name="one", version="1.0")))
    upload(
        client, write_key, build_archive(package_files(name="two", version="2.0", workflow="w2"))
    )
    upload(client, other_write_key, build_archive(package_files(name="one", version="9.0")))
    assert not WorkflowPackage.objects.filter(superseded=True).exists()
    assert active_package(tenant, "demo").name == "one"
    assert active_package(other_tenant, "demo").version == "9.0"


@pytest.fixture(scope="module")
def zip_bomb() -> bytes:
    """~1 MB on the wire, 240 MB expanded (over the 200 MB default limit)."""
    out = io.BytesIO()
    zeros = b"\0" * (60 * 1024 * 1024)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=1) as zf:
        for name, content in package_files().items():
            zf.writestr(name, content)
        for i in range(4):
            zf.writestr(f"vendor/blob{i}.bin", zeros)
    return out.getvalue()


@pytest.mark.parametrize("case", sorted(BAD_UPLOADS))
def test_a_bad_upload_is_refused_and_stores_nothing(client, write_key, case):
    make, status, problem = BAD_UPLOADS[case]
    response = upload(client, write_key, make())
    assert response.status_code == status, response.content
    assert problem in response.json()["detail"]
    assert_nothing_stored()


def test_a_zip_bomb_is_refused(client, write_key, zip_bomb):
    response = upload(client, write_key, zip_bomb, "bomb.zip")
    assert response.status_code == 400
    assert "expands to more than" in response.json()["detail"]
    assert_nothing_stored()


def test_an_oversized_upload_is_refused(client, write_key, settings, monkeypatch):
    from dataclasses import replace

    from fleet.platform import config

    monkeypatch.setattr(config, "_config", replace(config.get_config(), max_package_bytes=100))
    response = upload(client, write_key, example_archive())
    assert response.status_code == 413
    assert "limit is 100" in response.json()["detail"]
    assert_nothing_stored()


def set_config(monkeypatch, **values) -> None:
    from dataclasses import replace

    from fleet.platform import config

    monkeypatch.setattr(config, "_config", replace(config.get_config(), **values))


def hardlink_farm(copies: int, size: int = 64 * 1024) -> bytes:
    """A valid package plus ``size`` random bytes and ``copies`` hard links to them: the
    upload carries the bytes once, the canonical archive stores every link as a copy."""
    blob = random.Random(13).randbytes(size)
    links = [(f"vendor/copy{i}.bin", b"", "hard:vendor/blob.bin") for i in range(copies)]
    return with_valid(("vendor/blob.bin", blob, ""), *links)


def test_an_archive_that_rebuilds_past_the_package_limit_is_refused(client, write_key, monkeypatch):
    data = hardlink_farm(40)  # ~65 KB uploaded, ~2.6 MB rebuilt
    set_config(monkeypatch, max_package_bytes=1024 * 1024)
    assert len(data) < 100 * 1024
    response = upload(client, write_key, data)
    assert response.status_code == 413, response.content
    assert re.fullmatch(
        r"package demo 1\.0\.0 rebuilds to a 26\d{5}-byte archive \(links stored as copies\); "
        r"the limit is 1048576 \(CLOACINA_MAX_PACKAGE_BYTES\)",
        response.json()["detail"],
    ), response.json()
    assert_nothing_stored()


def test_a_per_target_build_that_rebuilds_past_the_package_limit_is_refused(
    client, write_key, monkeypatch
):
    assert upload(client, write_key, native()).status_code == 201
    farm = package_files(kind="native")
    farm["workflow/demo/native.txt"] = ""
    blob = random.Random(9).randbytes(64 * 1024)
    links = [(f"vendor/copy{i}.bin", b"", "hard:vendor/blob.bin") for i in range(40)]
    data = bad_tar(
        *[(k, v.encode(), "") for k, v in farm.items()], ("vendor/blob.bin", blob, ""), *links
    )
    set_config(monkeypatch, max_package_bytes=1024 * 1024)
    response = upload_target(client, write_key, data)
    assert response.status_code == 413, response.content
    assert f"the {ARM} build of demo 1.0.0 rebuilds to a" in response.json()["detail"]
    assert "CLOACINA_MAX_PACKAGE_BYTES" in response.json()["detail"]
    assert PackageArtifact.objects.count() == 0


# --- storage quota --------------------------------------------------------------------


def stored_bytes(tenant) -> int:
    rows = [*WorkflowPackage.objects.filter(tenant=tenant)]
    rows += [*PackageArtifact.objects.filter(tenant=tenant)]
    return sum(row.size for row in rows)


def test_uploads_past_the_platform_storage_quota_are_refused(
    client, write_key, tenant, monkeypatch
):
    first = native("1.0.0")
    assert upload(client, write_key, first).status_code == 201
    used = stored_bytes(tenant)
    set_config(monkeypatch, tenant_storage_bytes=used + 100)
    # The same content again stores nothing: still fine.
    assert upload(client, write_key, first).status_code == 200
    blobs = ArtifactBlob.objects.count()
    response = upload(client, write_key, native("2.0.0"))
    assert response.status_code == 413, response.content
    detail = response.json()["detail"]
    assert re.fullmatch(
        rf"storage quota exceeded: tenant acme stores {used} bytes of packages and builds, this "
        rf"upload adds \d+, the quota is {used + 100} bytes \(CLOACINA_TENANT_STORAGE_BYTES\)",
        detail,
    ), detail
    # Per-target builds count too.
    target = upload_target(client, write_key, native("1.0.0", marker="arm"))
    assert target.status_code == 413 and "storage quota exceeded" in target.json()["detail"]
    assert WorkflowPackage.objects.count() == 1 and PackageArtifact.objects.count() == 0
    assert ArtifactBlob.objects.count() == blobs
    # 0 means unlimited.
    set_config(monkeypatch, tenant_storage_bytes=0)
    assert upload(client, write_key, native("2.0.0")).status_code == 201


def test_a_tenants_own_quota_wins_and_other_tenants_do_not_count(
    client, write_key, other_write_key, tenant, other_tenant, monkeypatch
):
    set_config(monkeypatch, tenant_storage_bytes=1)  # the platform default would refuse all
    tenant.storage_quota_bytes = 10 * 1024 * 1024
    tenant.save(update_fields=["storage_quota_bytes"])
    assert upload(client, write_key, native("1.0.0")).status_code == 201
    refused = upload(client, other_write_key, native("1.0.0"))
    assert refused.status_code == 413
    assert "tenant globex stores 0 bytes" in refused.json()["detail"]
    assert "the quota is 1 bytes (CLOACINA_TENANT_STORAGE_BYTES)" in refused.json()["detail"]
    tenant.storage_quota_bytes = stored_bytes(tenant) + 10
    tenant.save(update_fields=["storage_quota_bytes"])
    response = upload(client, write_key, native("2.0.0"))
    assert response.status_code == 413
    assert (
        f"the quota is {stored_bytes(tenant) + 10} bytes (tenant acme's storage_quota_bytes)"
        in (response.json()["detail"])
    )
    tenant.storage_quota_bytes = 0  # unlimited, whatever the platform says
    tenant.save(update_fields=["storage_quota_bytes"])
    assert upload(client, write_key, native("2.0.0")).status_code == 201


def test_a_missing_file_field_is_a_422(client, write_key):
    response = client.post("/api/v1/packages", {}, **bearer(write_key))
    assert response.status_code == 422
    assert_nothing_stored()


# --- roles --------------------------------------------------------------------------


def test_a_read_key_cannot_upload(client, read_key):
    response = upload(client, read_key, example_archive())
    assert response.status_code == 403 and "read key" in response.json()["detail"]
    assert_nothing_stored()


def test_no_key_is_a_401(client):
    response = client.post(
        "/api/v1/packages", {"file": SimpleUploadedFile("p.tar.gz", example_archive())}
    )
    assert response.status_code == 401
    assert client.get("/api/v1/packages").status_code == 401
    assert client.get("/api/v1/artifacts/" + "0" * 64).status_code == 401
    assert_nothing_stored()


def test_an_agent_key_cannot_upload_or_list(client, agent_key):
    assert upload(client, agent_key, example_archive()).status_code == 403
    assert client.get("/api/v1/packages", **bearer(agent_key)).status_code == 403


def test_write_and_read_keys_cannot_download(client, write_key, read_key):
    digest = upload(client, write_key, example_archive()).json()["digest"]
    for key in (write_key, read_key):
        assert client.get(f"/api/v1/artifacts/{digest}", **bearer(key)).status_code == 403


# --- listing ------------------------------------------------------------------------


def test_it_lists_only_the_tenants_packages(client, write_key, read_key, other_write_key):
    upload(client, write_key, native())
    upload_target(client, write_key, native())
    upload(client, other_write_key, example_archive())
    response = client.get("/api/v1/packages", **bearer(read_key))
    assert response.status_code == 200
    (item,) = response.json()
    assert item["name"] == "demo" and item["kind"] == "native" and item["workflow"] == "demo"
    assert item["superseded"] is False and item["built_at"]
    assert item["artifacts"] == [
        {"target_triple": ARM, "digest": PackageArtifact.objects.get().content_hash}
    ]

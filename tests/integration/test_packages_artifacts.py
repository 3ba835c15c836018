"""Per-target builds of native packages and artifact download, including tenant isolation."""

from __future__ import annotations

import hashlib

import pytest
from django.test import Client

from agents.protocol.triples import host_triple
from agents.sandbox import archive
from artifacts.models import ArtifactBlob, PackageArtifact, WorkflowPackage
from artifacts.store.queries import resolve_artifact, runnable_triples
from artifacts.store.testing import build_archive, example_archive, package_files
from fleet.models import ApiKey
from tests.support.keys import bearer
from tests.support.packages import ARM, T, native, upload, upload_target, with_valid

pytestmark = pytest.mark.django_db


@pytest.fixture
def client() -> Client:
    return Client()


# --- per-target artifacts ----------------------------------------------------------


def test_it_stores_a_per_target_build(client, write_key, tenant):
    primary = upload(client, write_key, native()).json()
    data = native(marker="arm build")
    response = upload_target(client, write_key, data, digest=hashlib.sha256(data).hexdigest())
    assert response.status_code == 201, response.content
    body = response.json()
    assert body["package"] == "demo" and body["version"] == "1.0.0"
    assert body["target_triple"] == ARM and body["digest"] != primary["digest"]
    package = WorkflowPackage.objects.get()
    assert runnable_triples(package) == {host_triple(), ARM}
    assert resolve_artifact(package, ARM).digest == body["digest"]
    assert resolve_artifact(package, host_triple()).digest == primary["digest"]
    assert resolve_artifact(package, "riscv64gc-unknown-linux-gnu") is None
    # Identical content again: idempotent; different content: conflict.
    assert upload_target(client, write_key, data).status_code == 200
    response = upload_target(client, write_key, native(marker="other"))
    assert response.status_code == 409 and ARM in response.json()["detail"]
    assert PackageArtifact.objects.count() == 1 and ArtifactBlob.objects.count() == 2


def test_python_packages_need_no_target_builds(client, write_key):
    upload(client, write_key, build_archive(package_files()))
    response = upload_target(client, write_key, build_archive(package_files()))
    assert response.status_code == 422
    assert "python packages are architecture-independent" in response.json()["detail"]
    assert PackageArtifact.objects.count() == 0
    package = WorkflowPackage.objects.get()
    assert runnable_triples(package) is None
    assert resolve_artifact(package, ARM).target_triple == ARM


@pytest.mark.parametrize(
    "triple, problem",
    [
        ("x86_64-linux", "malformed target triple"),
        ("m68k-unknown-linux-gnu", "unknown architecture"),
    ],
)
def test_a_bad_triple_is_a_422(client, write_key, triple, problem):
    upload(client, write_key, native())
    response = upload_target(client, write_key, native(marker="x"), triple=triple)
    assert response.status_code == 422 and problem in response.json()["detail"]
    assert PackageArtifact.objects.count() == 0


def test_an_unknown_package_or_version_is_a_404(client, write_key):
    upload(client, write_key, native())
    assert upload_target(client, write_key, native(), version="2.0.0").status_code == 404
    response = upload_target(client, write_key, native(), name="nope")
    assert response.status_code == 404 and "nope" in response.json()["detail"]


def test_the_archive_must_match_the_url(client, write_key):
    upload(client, write_key, native())
    upload(client, write_key, native(version="2.0.0"))
    response = upload_target(client, write_key, native(version="2.0.0", marker="arm"))
    assert response.status_code == 422
    assert "2.0.0" in response.json()["detail"] and "1.0.0" in response.json()["detail"]
    changed_dag = build_archive(package_files(kind="native", tasks=[T]))
    response = upload_target(client, write_key, changed_dag)
    assert response.status_code == 422 and "same DAG" in response.json()["detail"]
    assert PackageArtifact.objects.count() == 0


def test_a_wrong_digest_is_a_422(client, write_key):
    upload(client, write_key, native())
    response = upload_target(client, write_key, native(marker="arm"), digest="ab" * 32)
    assert response.status_code == 422 and "does not match" in response.json()["detail"]
    assert PackageArtifact.objects.count() == 0


def test_a_bad_target_archive_stores_nothing(client, write_key):
    upload(client, write_key, native())
    blobs = ArtifactBlob.objects.count()
    response = upload_target(client, write_key, with_valid(("../x", b"", "")))
    assert response.status_code == 400
    assert PackageArtifact.objects.count() == 0 and ArtifactBlob.objects.count() == blobs


def test_target_builds_are_invisible_to_other_tenants(
    client, write_key, other_write_key, other_tenant
):
    upload(client, write_key, native())
    digest = upload_target(client, write_key, native(marker="arm")).json()["digest"]
    # Tenant B has no package demo: its per-target upload is a 404, not a write into A's.
    assert upload_target(client, other_write_key, native(marker="arm")).status_code == 404
    # B publishes its own demo 1.0.0; its per-target build for the same triple is independent.
    upload(client, other_write_key, native())
    response = upload_target(client, other_write_key, native(marker="b's arm build"))
    assert response.status_code == 201
    assert PackageArtifact.objects.filter(tenant=other_tenant).get().content_hash != digest

    other_reader = ApiKey.mint("read", tenant=other_tenant)[1]
    listing = client.get("/api/v1/packages", **bearer(other_reader)).json()
    assert digest not in str(listing)


# --- download -----------------------------------------------------------------------


def test_an_agent_downloads_its_tenants_artifact(client, write_key, agent_key):
    digest = upload(client, write_key, example_archive()).json()["digest"]
    response = client.get(f"/api/v1/artifacts/{digest}", **bearer(agent_key))
    assert response.status_code == 200
    assert response["Content-Type"] == "application/octet-stream"
    assert response["X-Content-SHA256"] == digest
    assert hashlib.sha256(response.content).hexdigest() == digest


def test_an_agent_downloads_a_per_target_build(client, write_key, agent_key):
    upload(client, write_key, native())
    digest = upload_target(client, write_key, native(marker="arm")).json()["digest"]
    response = client.get(f"/api/v1/artifacts/{digest}", **bearer(agent_key))
    assert (
        response.status_code == 200
        and b"arm" in archive.read_members(response.content)["workflow/demo/native.txt"]
    )


def test_another_tenants_digest_looks_absent(client, write_key, other_tenant):

    upload(client, write_key, native())
    primary = WorkflowPackage.objects.get().digest
    target = upload_target(client, write_key, native(marker="arm")).json()["digest"]
    other_agent = ApiKey.mint("agent", tenant=other_tenant)[1]
    missing = client.get("/api/v1/artifacts/" + "f" * 64, **bearer(other_agent))
    assert missing.status_code == 404
    for digest in (primary, target):
        response = client.get(f"/api/v1/artifacts/{digest}", **bearer(other_agent))
        assert response.status_code == 404
        assert response.json()["detail"] == missing.json()["detail"].replace("f" * 64, digest)


def test_a_malformed_digest_is_a_404(client, agent_key):
    response = client.get("/api/v1/artifacts/not-a-digest", **bearer(agent_key))
    assert response.status_code == 404

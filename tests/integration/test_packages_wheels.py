"""The build step that vendors platform wheels (artifacts/store/wheels.py, POST .../builds,
run as a background job: artifacts/builds/jobs.py, artifacts/builds/runner.py).

Most tests run the real ``pip download`` against a local find-links directory of
wheels built here (no index, no operator pip config), so they are fast and offline;
the ``network`` test fetches a real compiled wheel from the package index.

Here: the integration tests (database, in-process ASGI, fakes); the rest are in tests/unit/test_packages_wheels.py.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from django.test import Client

from agents.protocol.triples import host_triple
from agents.sandbox import archive
from artifacts.models import ArtifactBlob, BuildJob, PackageArtifact, WorkflowPackage
from artifacts.store import wheels
from artifacts.store.queries import resolve_artifact
from artifacts.store.storage import load_blob
from artifacts.store.testing import build_archive, package_files
from tests.support.keys import bearer
from tests.support.packages import (
    ARM,
    ARM_SO,
    HOST_SO,
    X86,
    build,
    native_with_requirements,
    run_builds,
    status,
    upload,
)

ELF_MACHINE_AARCH64 = 183

ELF_MACHINE_X86_64 = 62

BUILDS = pytest.mark.django_db(transaction=True)


@pytest.fixture
def client() -> Client:
    return Client()


def build_and_wait(client: Client, key: str, **kwargs) -> dict:
    """POST the build (202), run the queued jobs, return the finished job's status."""
    queued = build(client, key, **kwargs)
    assert queued.status_code == 202, queued.content
    assert queued.json()["state"] == "queued"
    assert run_builds() == 1
    return status(client, key, queued)


@BUILDS
def test_it_builds_a_target_artifact_from_a_local_index(client, write_key, tenant, local_index):
    primary = native_with_requirements(
        "fakeext==1.0\n", **{f"vendor/{HOST_SO}": b"x86 build", "vendor/mylib.py": b"mine"}
    )
    assert upload(client, write_key, primary).status_code == 201
    queued = build(client, write_key)
    assert queued.status_code == 202, queued.content
    body = queued.json()
    assert body["status_url"] == f"/api/v1/builds/{body['id']}"
    assert (body["state"], body["package"], body["version"], body["target_triple"]) == (
        "queued", "demo", "1.0.0", ARM
    )  # fmt: skip
    assert body["digest"] is None and body["started_at"] is None
    assert PackageArtifact.objects.count() == 0  # nothing is built inside the request
    assert run_builds() == 1
    done = status(client, write_key, queued)
    assert done["state"] == "succeeded" and done["detail"] is None, done
    assert done["new_artifact"] is True and done["attempts"] == 1
    wheel_bytes = sum(p.stat().st_size for p in local_index.glob("*.whl"))
    assert done["bytes_downloaded"] == wheel_bytes
    assert done["created_at"] <= done["started_at"] <= done["finished_at"]
    package = WorkflowPackage.objects.get()
    assert resolve_artifact(package, ARM).digest == done["digest"] != package.digest
    members = archive.read_members(load_blob(done["digest"]))
    assert members[f"vendor/{ARM_SO}"] == b"\x7fELF arm"
    assert members["vendor/fakedep.py"] == b"X = 1\n"  # the dependency, resolved by pip
    assert f"vendor/{HOST_SO}" not in members and members["vendor/mylib.py"] == b"mine"
    assert (
        members["workflow/demo/steps.py"] == archive.read_members(primary)["workflow/demo/steps.py"]
    )
    assert not any("/scripts/" in name or ".data/" in name for name in members)
    # Deterministic: building again gives the same bytes, so it is the stored build.
    again = build_and_wait(client, write_key)
    assert again["id"] != done["id"] and again["state"] == "succeeded"
    assert again["digest"] == done["digest"] and again["new_artifact"] is False
    # The synchronous service call code uses; "1.0" names 1.0.0 (PEP 440 equality).
    assert wheels.build_target_artifact(tenant, "demo", "1.0", ARM).content_hash == done["digest"]
    assert PackageArtifact.objects.count() == 1
    listed = client.get("/api/v1/packages", **bearer(write_key)).json()[0]["artifacts"]
    assert listed == [{"target_triple": ARM, "digest": done["digest"]}]


@BUILDS
def test_a_missing_platform_wheel_fails_the_job_naming_requirement_and_platform(
    client, write_key, local_index
):
    upload(client, write_key, native_with_requirements("fakeext==1.0\n"))
    blobs = ArtifactBlob.objects.count()
    done = build_and_wait(client, write_key, triple=X86)  # fakeext has an aarch64 wheel only
    assert done["state"] == "failed" and done["error_status"] == 422
    detail = done["detail"]
    assert "'fakeext==1.0' has no wheel for x86_64-unknown-linux-gnu" in detail
    assert "manylinux_2_28_x86_64" in detail and "versions with such a wheel: none" in detail
    assert done["digest"] is None and done["finished_at"] is not None
    assert PackageArtifact.objects.count() == 0 and ArtifactBlob.objects.count() == blobs


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@BUILDS
@pytest.mark.parametrize("correct", [True, False])
def test_hashes_are_checked(client, write_key, local_index, correct):
    ext = _sha256(next(local_index.glob("fakeext-*.whl"))) if correct else "0" * 64
    dep = _sha256(next(local_index.glob("fakedep-*.whl")))
    requirements = f"fakeext==1.0 --hash=sha256:{ext}\nfakedep==1.0 --hash=sha256:{dep}\n"
    upload(client, write_key, native_with_requirements(requirements))
    done = build_and_wait(client, write_key)
    if correct:
        assert done["state"] == "succeeded", done
    else:
        assert done["state"] == "failed" and done["error_status"] == 422
        assert "failed its --hash check" in done["detail"]
        assert PackageArtifact.objects.count() == 0


@BUILDS
def test_a_pip_that_takes_too_long_fails_the_job_with_504(
    client, write_key, local_index, monkeypatch
):
    upload(client, write_key, native_with_requirements("fakeext==1.0\n"))
    monkeypatch.setattr(wheels, "PIP_TIMEOUT_S", 0.05)
    done = build_and_wait(client, write_key)
    assert done["state"] == "failed" and done["error_status"] == 504
    assert "did not finish within" in done["detail"]
    assert PackageArtifact.objects.count() == 0


@pytest.mark.django_db
@pytest.mark.parametrize(
    "requirements, url, triple, status, problem",
    [
        ("fakeext==1.0\n", "nope/1.0.0", ARM, 404, "package nope version 1.0.0 not found"),
        ("fakeext==1.0\n", "demo/2.0.0", ARM, 404, "not found"),
        ("fakeext==1.0\n", "demo/1.0.0", "x86_64-linux", 422, "malformed target triple"),
        ("fakeext==1.0\n", "demo/1.0.0", "aarch64-apple-darwin", 422, "no wheel platform"),
        (None, "demo/1.0.0", ARM, 422, "has no top-level requirements.txt"),
        ("--index-url http://evil/\n", "demo/1.0.0", ARM, 422, "option '--index-url'"),
    ],
)
def test_bad_requests_are_clear_4xx_at_once_and_queue_nothing(
    client, write_key, local_index, requirements, url, triple, status, problem
):
    upload(client, write_key, native_with_requirements(requirements))
    blobs = ArtifactBlob.objects.count()
    name, version = url.split("/")
    response = build(client, write_key, triple=triple, name=name, version=version)
    assert response.status_code == status and problem in response.json()["detail"]
    assert BuildJob.objects.count() == 0
    assert PackageArtifact.objects.count() == 0 and ArtifactBlob.objects.count() == blobs


@pytest.mark.django_db
def test_python_packages_take_no_builds(client, write_key, local_index):
    files = package_files()
    files["requirements.txt"] = "fakeext==1.0\n"
    upload(client, write_key, build_archive(files))
    response = build(client, write_key)
    assert response.status_code == 422 and "python package" in response.json()["detail"]
    assert BuildJob.objects.count() == 0


@pytest.mark.django_db
def test_roles_tenants_and_body_are_checked(
    client, write_key, read_key, other_write_key, local_index
):
    upload(client, write_key, native_with_requirements("fakeext==1.0\n"))
    assert build(client, read_key).status_code == 403
    # Tenant B sees no package demo of tenant A.
    assert build(client, other_write_key).status_code == 404
    response = client.post(
        "/api/v1/packages/demo/1.0.0/builds",
        "{}",
        content_type="application/json",
        **bearer(write_key),
    )
    assert response.status_code == 422 and "target_triple" in json.dumps(response.json())
    assert BuildJob.objects.count() == 0
    queued = build(client, write_key)
    assert queued.status_code == 202
    url = queued.json()["status_url"]
    # A read key of the tenant follows the build; another tenant's key gets a plain 404.
    assert client.get(url, **bearer(read_key)).json()["state"] == "queued"
    other = client.get(url, **bearer(other_write_key))
    missing = client.get(f"/api/v1/builds/{uuid.uuid4()}", **bearer(other_write_key))
    assert other.status_code == missing.status_code == 404
    assert client.get("/api/v1/builds/not-a-uuid", **bearer(read_key)).status_code == 422


def _elf_machine(data: bytes) -> int:
    assert data[:4] == b"\x7fELF"
    return int.from_bytes(data[18:20], "little")


@pytest.mark.network
@BUILDS
def test_it_vendors_real_msgpack_wheels(client, write_key, tmp_path):
    """msgpack 1.2.4 ships compiled manylinux wheels for both arches: the aarch64 build
    carries an aarch64 extension, and the host build imports from vendor/ in a fresh
    interpreter."""
    upload(client, write_key, native_with_requirements("msgpack==1.2.4\n"))
    arm = build_and_wait(client, write_key, triple=ARM)
    assert arm["state"] == "succeeded", arm
    assert arm["bytes_downloaded"] > 50_000  # the compiled wheel, fetched from the index
    members = archive.read_members(load_blob(arm["digest"]))
    compiled = [n for n in members if n.startswith("vendor/msgpack/") and n.endswith(".so")]
    assert compiled and all("aarch64" in n for n in compiled)
    assert {_elf_machine(members[n]) for n in compiled} == {ELF_MACHINE_AARCH64}
    assert any(n.startswith("vendor/msgpack-1.2.4.dist-info/") for n in members)

    if host_triple() != X86:
        pytest.skip("the import check needs an x86_64 Linux host")
    host = build_and_wait(client, write_key, triple=X86)
    assert host["state"] == "succeeded", host
    archive.safe_extract(load_blob(host["digest"]), tmp_path / "pkg")
    vendor = tmp_path / "pkg" / "vendor"
    code = (
        f"import sys; sys.path.insert(0, {str(vendor)!r}); import msgpack, msgpack._cmsgpack as c; "
        f"assert c.__file__.startswith({str(vendor)!r}), c.__file__; "
        "assert msgpack.unpackb(msgpack.packb({'a': 1})) == {'a': 1}; print(c.__file__)"
    )
    run = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert _elf_machine((vendor / Path(run.stdout.strip()).relative_to(vendor)).read_bytes()) == (
        ELF_MACHINE_X86_64
    )

"""Builds as background jobs (artifacts/builds/jobs.py, artifacts/builds/runner.py).

What a hostile tenant could do with builds run inside the request (issue 13): hold a
pooled connection for up to 300 s per build, start any number at once, download without
bound. Here: 202 + a durable job, one active build per tenant, a global cap that holds
across servers claiming at once, no connection held while pip runs, pip killed past the
download cap, and jobs of dead or stopping servers queued again.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import replace
from datetime import timedelta

import pytest
from django.db import IntegrityError, close_old_connections, connection
from django.test import Client
from django.utils import timezone

from artifacts.builds import jobs as build_jobs
from artifacts.builds.runner import BuildRunner
from artifacts.models import BuildJob, BuildState, PackageArtifact
from artifacts.store import wheels
from artifacts.store.services import publish_package
from fleet.api.error_status import http_status
from fleet.models import ServerInstance, Tenant
from fleet.platform import config
from tests.support.packages import (
    ARM,
    X86,
    build,
    native_with_requirements,
    run_builds,
    status,
    upload,
)
from tests.support.racing import race
from tests.support.slow_index import (
    MiB,
    slow_index_env,
    start_slow_index,
)
from tests.support.waiting import wait_until

pytestmark = pytest.mark.django_db(transaction=True)


@pytest.fixture
def client() -> Client:
    return Client()


def _cap(monkeypatch, **values) -> None:
    monkeypatch.setattr(config, "_config", replace(config.get_config(), **values))


# --- a package index that streams a large wheel slowly ---------------------------------


@pytest.fixture
def slow_index(monkeypatch):
    server = start_slow_index()
    monkeypatch.delenv("PIP_NO_INDEX", raising=False)
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    for name, value in slow_index_env(server).items():
        monkeypatch.setenv(name, value)
    yield server
    server.shutdown()
    server.server_close()


# --- the request answers at once; the build runs on serve's threads ---------------------


def test_serves_threads_run_the_build_holding_no_connection_while_pip_runs(
    client, write_key, local_index, monkeypatch
):
    upload(client, write_key, native_with_requirements("fakeext==1.0\n"))
    seen: list[tuple[str, object]] = []
    real_run_pip = wheels._run_pip

    def watching(*args, **kwargs):
        seen.append((threading.current_thread().name, connection.connection))
        return real_run_pip(*args, **kwargs)

    monkeypatch.setattr(wheels, "_run_pip", watching)
    started = time.monotonic()
    queued = build(client, write_key)
    assert queued.status_code == 202 and time.monotonic() - started < 2.0
    runner = BuildRunner("server-a")
    try:
        assert runner.start_builds() == 1
        done = wait_until(
            lambda: (s := status(client, write_key, queued))["state"] == "succeeded" and s,
            timeout=30,
            what="the build to succeed",
        )
    finally:
        runner.stop()
    assert done["digest"] and done["attempts"] == 1
    # pip ran on one of the runner's threads, and that thread held no database connection.
    assert [name.startswith("cloacina-build") for name, _ in seen] == [True]
    assert seen[0][1] is None
    assert PackageArtifact.objects.get().content_hash == done["digest"]


# --- one build per tenant at a time -----------------------------------------------------


def test_a_tenant_has_one_build_at_a_time_others_are_not_blocked(
    client, write_key, other_write_key, local_index, monkeypatch
):
    upload(client, write_key, native_with_requirements("fakeext==1.0\n"))
    upload(client, other_write_key, native_with_requirements("fakeext==1.0\n"))
    first = build(client, write_key)
    assert first.status_code == 202
    # The same build again joins the queued one.
    again = build(client, write_key)
    assert again.status_code == 202 and again.json()["id"] == first.json()["id"]
    # Another build of the same tenant: 409 naming the active one, before the request
    # reads the package's archive.
    real_prepare = wheels.prepare_build

    def unread(*args):
        raise AssertionError("the archive was read for a refused build")

    monkeypatch.setattr(wheels, "prepare_build", unread)
    other_triple = build(client, write_key, triple=X86)
    monkeypatch.setattr(wheels, "prepare_build", real_prepare)
    assert other_triple.status_code == 409
    detail = other_triple.json()["detail"]
    assert first.json()["status_url"] in detail and "one build per tenant at a time" in detail
    # Another tenant is not held up by it.
    assert build(client, other_write_key).status_code == 202
    assert BuildJob.objects.count() == 2
    # The database refuses a second active build of a tenant whatever the code does.
    job = BuildJob.objects.get(pk=first.json()["id"])
    with pytest.raises(IntegrityError):
        BuildJob.objects.create(
            id=uuid.uuid4(), tenant=job.tenant, package=job.package, package_name="demo",
            version="1.0.0", target_triple=X86, state=BuildState.RUNNING,
        )  # fmt: skip
    assert run_builds() == 2
    after = build(client, write_key, triple=X86)
    assert after.status_code == 202 and after.json()["id"] != first.json()["id"]


# --- the global cap, with several servers claiming at once ------------------------------


def _queued_jobs(count: int) -> list[BuildJob]:
    jobs = []
    archive = native_with_requirements("fakeext==1.0\n")
    for index in range(count):
        tenant = Tenant.objects.create(name=f"tenant-{index}")
        package, _ = publish_package(tenant, archive)
        jobs.append(build_jobs.enqueue_build(tenant, package, ARM)[0])
    return jobs


def _claim_at_once(servers: int, slots: int, cap: int) -> list[list[uuid.UUID]]:
    """``servers`` threads (each its own connection, like serve replicas) claim together."""
    return race(servers, lambda i: [j.pk for j in build_jobs.claim_builds(f"s{i}", slots, cap)])


def test_servers_claiming_at_once_respect_the_global_cap_and_never_share_a_job():
    jobs = _queued_jobs(7)
    claimed = _claim_at_once(servers=4, slots=5, cap=2)
    ids = [pk for server in claimed for pk in server]
    assert len(ids) == 2 == len(set(ids))  # not 4 × 2, not 4 × 5
    assert BuildJob.objects.filter(state=BuildState.RUNNING).count() == 2
    # Oldest first: the first two queued.
    assert set(ids) == {jobs[0].pk, jobs[1].pk}
    # With room for all, four servers taking one each get four different jobs.
    claimed = _claim_at_once(servers=4, slots=1, cap=100)
    ids = [pk for server in claimed for pk in server]
    assert len(ids) == 4 == len(set(ids)) and not set(ids) & {jobs[0].pk, jobs[1].pk}
    running = BuildJob.objects.filter(state=BuildState.RUNNING)
    assert running.count() == 6 and all(j.attempts == 1 for j in running)


# --- the download cap --------------------------------------------------------------------


def test_pip_is_killed_past_the_download_cap(client, write_key, slow_index, monkeypatch):
    _cap(monkeypatch, max_build_download_bytes=1 * MiB)
    upload(client, write_key, native_with_requirements("bigext==1.0\n"))
    queued = build(client, write_key)
    started = time.monotonic()
    assert run_builds() == 1
    elapsed = time.monotonic() - started
    done = status(client, write_key, queued)
    assert done["state"] == "failed" and done["error_status"] == 413, done
    assert "CLOACINA_MAX_BUILD_DOWNLOAD_BYTES" in done["detail"]
    # Killed soon after the cap, not after the whole 64 MiB wheel (~10 s at this pace).
    assert 1 * MiB < done["bytes_downloaded"] < 4 * MiB, done["bytes_downloaded"]
    wait_until(lambda: slow_index.aborted, timeout=5, what="the index to see pip go away")
    assert slow_index.sent < 16 * MiB
    assert PackageArtifact.objects.count() == 0
    print(f"\ncap 1 MiB: killed at {done['bytes_downloaded']} bytes after {elapsed:.2f} s")


def test_a_download_over_the_cap_is_refused_even_when_it_finishes_between_looks(
    client, write_key, local_index, monkeypatch
):
    # A local index: pip copies the wheels in a few ms, faster than the watcher looks.
    _cap(monkeypatch, max_build_download_bytes=200)
    monkeypatch.setattr(wheels, "PIP_WATCH_INTERVAL_S", 60.0)
    upload(client, write_key, native_with_requirements("fakeext==1.0\n"))
    queued = build(client, write_key)
    run_builds()
    done = status(client, write_key, queued)
    assert done["state"] == "failed" and done["error_status"] == 413, done
    assert done["bytes_downloaded"] == sum(p.stat().st_size for p in local_index.glob("*.whl"))
    assert PackageArtifact.objects.count() == 0


# --- restarts: stopping servers and dead ones -------------------------------------------


def test_a_stopping_server_kills_pip_and_queues_its_build_again(client, write_key, slow_index):
    upload(client, write_key, native_with_requirements("bigext==1.0\n"))
    queued = build(client, write_key)
    runner = BuildRunner("server-a")
    assert runner.start_builds() == 1
    wait_until(lambda: slow_index.sent > 0, timeout=20, what="pip to start downloading")
    started = time.monotonic()
    runner.stop()
    assert time.monotonic() - started < 3.0
    job = status(client, write_key, queued)
    assert job["state"] == "queued" and job["attempts"] == 0, job
    assert "interrupted" in job["detail"]
    assert BuildJob.objects.get().claimed_by == ""
    wait_until(lambda: slow_index.aborted, timeout=5, what="pip to be killed")


def _server(name: str, **fields) -> str:
    ServerInstance.objects.create(id=name, host="h", pid=1, default_executor="default", **fields)
    return name


def _running(job: BuildJob, server: str, attempts: int = 1, started_ago_s: float = 1) -> BuildJob:
    BuildJob.objects.filter(pk=job.pk).update(
        state=BuildState.RUNNING,
        claimed_by=server,
        attempts=attempts,
        started_at=timezone.now() - timedelta(seconds=started_ago_s),
    )
    return BuildJob.objects.get(pk=job.pk)


def test_builds_of_dead_servers_are_queued_again_or_failed_after_their_attempts():
    live = _server("live")
    dead = _server("dead", stopped_at=timezone.now())
    silent = _server("silent", last_seen=timezone.now() - timedelta(minutes=5))
    fresh, of_dead, of_silent, stuck, unknown = _queued_jobs(5)
    fresh = _running(fresh, live)
    of_dead = _running(of_dead, dead)
    of_silent = _running(of_silent, silent, attempts=build_jobs.MAX_BUILD_ATTEMPTS)
    stuck = _running(stuck, live, started_ago_s=wheels.PIP_TIMEOUT_S + 400)
    unknown = _running(unknown, "never-registered")
    assert build_jobs.recover_orphaned_builds() == 4
    rows = {j.pk: j for j in BuildJob.objects.all()}
    assert rows[fresh.pk].state == BuildState.RUNNING  # a live server's build is left alone
    for job, words in (
        (of_dead, "server dead stopped"),
        (unknown, "server never-registered stopped"),
        (stuck, "server live recorded no outcome"),
    ):
        row = rows[job.pk]
        assert (row.state, row.claimed_by, row.started_at) == (BuildState.QUEUED, "", None)
        assert words in row.detail and row.attempts == 1
    failed = rows[of_silent.pk]
    assert failed.state == BuildState.FAILED and http_status(failed.error_kind) == 500
    assert "server silent stopped" in failed.detail and "after 2 attempts" in failed.detail
    # The dead server finishing late changes nothing: its claim is gone.
    assert not build_jobs.succeed_build(of_dead, "0" * 64, True, 1)
    assert BuildJob.objects.get(pk=of_dead.pk).state == BuildState.QUEUED
    # A queued-again build is claimed and counted as its second attempt.
    claimed = build_jobs.claim_builds("live", 10, 10)
    assert {j.pk: j.attempts for j in claimed}[of_dead.pk] == 2


def test_serve_schedules_the_build_jobs():
    runner = BuildRunner("server-a")
    try:
        jobs = {job.name: job for job in runner.periodic_jobs()}
    finally:
        runner.stop()
    assert jobs["start_builds"].func == runner.start_builds and not jobs["start_builds"].leader_only
    assert jobs["recover_orphaned_builds"].leader_only
    close_old_connections()

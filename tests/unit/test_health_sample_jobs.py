"""The health sampler's periodic jobs (fleet/control/health_samples.py), as serve schedules them."""

from __future__ import annotations

from fleet.control import health_samples


def test_the_sampler_and_its_pruning_run_on_the_leader_only():
    jobs = {job.name: job for job in health_samples.health_sample_jobs()}
    assert {name: (job.interval_s, job.leader_only) for name, job in jobs.items()} == {
        "tenant_health_samples": (60.0, True),
        "tenant_health_prune": (600.0, True),
    }
    assert jobs["tenant_health_samples"].func is health_samples.sample_tenant_health
    assert jobs["tenant_health_prune"].func is health_samples.prune_health_samples

"""A retry's plan: which re-opened tasks are Ready, Skipped or wait (fleet/engine/reruns.py).

The plan is a pure function of the tasks' dependencies, rules and statuses; the
database side (the rows written, the history) is in tests/integration/test_reruns.py.
"""

from __future__ import annotations

from fleet.engine.reruns import TaskState, retry_plan


def task(name: str, status: str, deps: tuple[str, ...] = (), rule: str = "all_success"):
    return TaskState(name, deps, rule, status)


def test_a_failed_task_after_completed_ones_is_ready_and_they_stay_out_of_the_plan():
    plan = retry_plan([task("a", "Completed"), task("b", "Failed", ("a",))])
    assert plan == {"b": "Ready"}


def test_a_failed_root_is_ready_and_what_was_skipped_after_it_waits_for_it():
    plan = retry_plan(
        [
            task("a", "Failed"),
            task("b", "Skipped", ("a",)),
            task("c", "Skipped", ("b",)),
            task("side", "Completed"),
        ]
    )
    assert plan == {"a": "Ready", "b": "NotStarted", "c": "NotStarted"}


def test_a_join_waits_while_any_of_its_dependencies_is_reopened():
    plan = retry_plan(
        [
            task("a", "Completed"),
            task("b", "Failed", ("a",)),
            task("c", "Completed", ("a",)),
            task("join", "Skipped", ("b", "c")),
        ]
    )
    assert plan == {"b": "Ready", "join": "NotStarted"}


def test_a_one_failed_task_whose_dependencies_all_completed_is_skipped_again_and_cascades():
    # "alert" (one_failed) was skipped because "load" completed; "report" (all_done) after it
    # failed.  Retrying re-decides both: alert is skipped again, report runs.
    plan = retry_plan(
        [
            task("load", "Completed"),
            task("alert", "Skipped", ("load",), "one_failed"),
            task("report", "Failed", ("alert",), "all_done"),
        ]
    )
    assert plan == {"alert": "Skipped", "report": "Ready"}


def test_a_one_failed_handler_waits_for_the_retried_task_it_handles():
    plan = retry_plan(
        [
            task("a", "Failed"),
            task("on_fail", "Completed", ("a",), "one_failed"),
            task("next", "Skipped", ("a",)),
        ]
    )
    # The handler ran and completed: it keeps its output and is not re-run.
    assert plan == {"a": "Ready", "next": "NotStarted"}


def test_a_long_chain_is_planned_without_recursion():
    chain = [task("t0", "Failed")] + [
        task(f"t{i}", "Skipped", (f"t{i - 1}",)) for i in range(1, 3000)
    ]
    plan = retry_plan(chain)
    assert plan["t0"] == "Ready" and plan["t2999"] == "NotStarted" and len(plan) == 3000

"""One name for each meaning: ``task_name`` is the manifest's task id, ``task_execution_id`` a
TaskExecution's uuid (the outbox and outcome columns were both called ``task_id``).

PostgreSQL carries a renamed column into the unique indexes built on it, so the three
constraints that name these fields are only re-declared in Django's state: no index is
dropped or rebuilt on a live table.
"""

from django.db import migrations, models


def _redeclare(model: str, old: models.UniqueConstraint, new: models.UniqueConstraint) -> list:
    return [
        migrations.RemoveConstraint(model_name=model, name=old.name),
        migrations.AddConstraint(model_name=model, constraint=new),
    ]


ONE_PACKET = ("deliveryoutbox", ("task", "assignment"), ("task_execution", "assignment"),
              "one_packet_per_assignment", None)
UNIQ_TASK = ("taskexecution", ("workflow_execution", "task_id"), ("workflow_execution", "task_name"),
             "uniq_task_per_execution", None)
ONE_APPLIED = ("taskoutcome", ("task", "assignment"), ("task_execution", "assignment"),
               "one_applied_outcome_per_assignment", models.Q(("applied", True)))


def _state_only() -> list:
    operations = []
    for model, old_fields, new_fields, name, condition in (ONE_PACKET, UNIQ_TASK, ONE_APPLIED):
        extra = {"condition": condition} if condition is not None else {}
        operations += _redeclare(
            model,
            models.UniqueConstraint(fields=old_fields, name=name, **extra),
            models.UniqueConstraint(fields=new_fields, name=name, **extra),
        )
    return operations


class Migration(migrations.Migration):
    dependencies = [("fleet", "0008_tenant_storage_quota_bytes")]

    operations = [
        migrations.RenameField("taskexecution", "task_id", "task_name"),
        migrations.RenameField("taskoutcome", "task", "task_execution"),
        migrations.RenameField("deliveryoutbox", "task", "task_execution"),
        migrations.SeparateDatabaseAndState(state_operations=_state_only(), database_operations=[]),
    ]

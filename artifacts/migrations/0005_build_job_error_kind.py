"""A failed build records why by kind (fleet.errors.ErrorKind), not by HTTP status: the
surface layer maps a kind to its status (cloacina_site/error_status.py)."""

from django.db import migrations, models

# The statuses the build path ever stored, and the kind each one meant.
KIND_OF_STATUS = {
    400: "malformed",
    404: "not_found",
    409: "conflict",
    413: "too_large",
    422: "invalid",
    429: "limited",
    500: "internal",
    502: "upstream_failed",
    503: "unavailable",
    504: "upstream_timeout",
}


def status_to_kind(apps, schema_editor):
    BuildJob = apps.get_model("artifacts", "BuildJob")
    for status, kind in KIND_OF_STATUS.items():
        BuildJob.objects.filter(error_status=status).update(error_kind=kind)
    # A status outside the table can only come from a bug; call it internal.
    BuildJob.objects.filter(error_status__isnull=False, error_kind="").update(error_kind="internal")


def kind_to_status(apps, schema_editor):
    BuildJob = apps.get_model("artifacts", "BuildJob")
    for status, kind in KIND_OF_STATUS.items():
        BuildJob.objects.filter(error_kind=kind).update(error_status=status)


class Migration(migrations.Migration):
    dependencies = [
        ("artifacts", "0004_package_build_jobs"),
    ]

    operations = [
        migrations.AddField(
            model_name="buildjob",
            name="error_kind",
            field=models.CharField(blank=True, default="", max_length=20),
        ),
        migrations.RunPython(status_to_kind, kind_to_status),
        migrations.RemoveField(model_name="buildjob", name="error_status"),
    ]

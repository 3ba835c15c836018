"""Cron schedules (fleet/schedules/): Schedule, and ScheduleFire unique per (schedule, fire_time)."""

import django.db.models.deletion
import django.utils.timezone
import uuid
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0010_fleetchange_note"),
    ]

    operations = [
        migrations.CreateModel(
            name="Schedule",
            fields=[
                (
                    "id",
                    models.UUIDField(
                        default=uuid.uuid4, editable=False, primary_key=True, serialize=False
                    ),
                ),
                ("workflow", models.CharField(max_length=200)),
                ("cron", models.CharField(max_length=120)),
                ("timezone", models.CharField(default="UTC", max_length=64)),
                ("context", models.JSONField(default=dict)),
                ("enabled", models.BooleanField(default=True)),
                (
                    "catchup",
                    models.CharField(
                        choices=[("skip", "Skip"), ("latest", "Latest"), ("all", "All")],
                        default="skip",
                        max_length=8,
                    ),
                ),
                (
                    "overlap",
                    models.CharField(
                        choices=[
                            ("allow", "Allow"),
                            ("skip", "Skip"),
                            ("cancel_previous", "Cancel Previous"),
                        ],
                        default="allow",
                        max_length=16,
                    ),
                ),
                (
                    "source",
                    models.CharField(
                        choices=[("api", "Api"), ("package", "Package")],
                        default="api",
                        max_length=8,
                    ),
                ),
                ("package_name", models.CharField(blank=True, default="", max_length=100)),
                ("package_version", models.CharField(blank=True, default="", max_length=64)),
                ("next_fire_at", models.DateTimeField(blank=True, null=True)),
                ("last_fire_at", models.DateTimeField(blank=True, null=True)),
                ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                ("updated_at", models.DateTimeField(default=django.utils.timezone.now)),
                (
                    "tenant",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="schedules",
                        to="fleet.tenant",
                    ),
                ),
            ],
            options={
                "ordering": ["created_at", "id"],
            },
        ),
        migrations.CreateModel(
            name="ScheduleFire",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("fire_time", models.DateTimeField()),
                (
                    "outcome",
                    models.CharField(
                        choices=[
                            ("started", "Started"),
                            ("skipped_overlap", "Skipped Overlap"),
                            ("missed", "Missed"),
                            ("failed_to_start", "Failed To Start"),
                            ("manual", "Manual"),
                        ],
                        max_length=16,
                    ),
                ),
                ("detail", models.CharField(blank=True, default="", max_length=300)),
                ("at", models.DateTimeField(default=django.utils.timezone.now)),
                (
                    "execution",
                    models.ForeignKey(
                        blank=True,
                        null=True,
                        on_delete=django.db.models.deletion.SET_NULL,
                        related_name="schedule_fires",
                        to="fleet.workflowexecution",
                    ),
                ),
                (
                    "schedule",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="fires",
                        to="fleet.schedule",
                    ),
                ),
            ],
            options={
                "ordering": ["-fire_time", "-id"],
            },
        ),
        migrations.AddIndex(
            model_name="schedule",
            index=models.Index(
                condition=models.Q(("enabled", True)), fields=["next_fire_at"], name="schedule_due"
            ),
        ),
        migrations.AddIndex(
            model_name="schedule",
            index=models.Index(fields=["tenant", "source", "package_name"], name="schedule_tenant"),
        ),
        migrations.AddConstraint(
            model_name="schedulefire",
            constraint=models.UniqueConstraint(
                fields=("schedule", "fire_time"), name="schedule_fire_once"
            ),
        ),
    ]

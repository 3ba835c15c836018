"""Named agent pools per tenant; every existing tenant gets its ``default`` pool.

The default pool's count is not stored (it is the tenant's desired_count minus the named
pools'), so giving existing tenants their default pool changes nothing they run.
"""

import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models


def give_every_tenant_a_default_pool(apps, schema_editor):
    Tenant = apps.get_model("fleet", "Tenant")
    AgentPool = apps.get_model("fleet", "AgentPool")
    AgentPool.objects.bulk_create(
        [
            AgentPool(tenant_id=pk, name="default")
            for pk in Tenant.objects.values_list("pk", flat=True)
        ],
        ignore_conflicts=True,
    )


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0012_fleetchange_audits_every_limit"),
    ]

    operations = [
        migrations.CreateModel(
            name="AgentPool",
            fields=[
                (
                    "id",
                    models.BigAutoField(
                        auto_created=True, primary_key=True, serialize=False, verbose_name="ID"
                    ),
                ),
                ("name", models.CharField(max_length=24)),
                ("tags", models.JSONField(blank=True, default=list)),
                ("capabilities", models.JSONField(blank=True, default=list)),
                ("max_concurrency", models.PositiveIntegerField(blank=True, null=True)),
                ("cpu", models.CharField(blank=True, default="", max_length=16)),
                ("memory", models.CharField(blank=True, default="", max_length=16)),
                ("gpu", models.PositiveIntegerField(default=0)),
                ("desired_count", models.PositiveIntegerField(default=0)),
                ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                (
                    "tenant",
                    models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="pools",
                        to="fleet.tenant",
                    ),
                ),
            ],
            options={
                "ordering": ["tenant", "id"],
                "constraints": [
                    models.UniqueConstraint(fields=("tenant", "name"), name="uniq_pool_name"),
                    models.CheckConstraint(
                        condition=models.Q(
                            models.Q(("name", "default"), _negated=True),
                            ("desired_count", 0),
                            _connector="OR",
                        ),
                        name="default_pool_count_derived",
                    ),
                ],
            },
        ),
        migrations.AddField(
            model_name="autoscaledecision",
            name="pool",
            field=models.CharField(default="default", max_length=24),
        ),
        migrations.RunPython(give_every_tenant_a_default_pool, migrations.RunPython.noop),
    ]

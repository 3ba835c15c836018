"""A FleetChange can say why in words: a clamp names what lowered the limit."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("fleet", "0009_task_name_and_task_execution_id")]

    operations = [
        migrations.AddField(
            model_name="fleetchange",
            name="note",
            field=models.CharField(blank=True, default="", max_length=300),
        ),
    ]

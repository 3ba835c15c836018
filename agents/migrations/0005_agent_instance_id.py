# The agent process id sent at registration (a re-registered process keeps it).

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('agents', '0004_agent_fallback_score'),
    ]

    operations = [
        migrations.AddField(
            model_name='agent',
            name='instance_id',
            field=models.UUIDField(blank=True, null=True),
        ),
    ]

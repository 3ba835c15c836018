# Issue 15: state `stopped` (a clean exit, distinct from `dead`; the unique live name now
# excludes both ended states) and each agent's circuit breaker (fleet/executors/fleet/state/breaker.py).

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('agents', '0005_agent_instance_id'),
    ]

    operations = [
        migrations.RemoveConstraint(
            model_name='agent',
            name='uniq_live_agent_name',
        ),
        migrations.AddField(
            model_name='agent',
            name='breaker_failures',
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.AddField(
            model_name='agent',
            name='breaker_open_until',
            field=models.DateTimeField(blank=True, null=True),
        ),
        migrations.AddField(
            model_name='agent',
            name='breaker_probing',
            field=models.BooleanField(default=False),
        ),
        migrations.AddField(
            model_name='agent',
            name='breaker_trips',
            field=models.PositiveIntegerField(default=0),
        ),
        migrations.AlterField(
            model_name='agent',
            name='state',
            field=models.CharField(choices=[('live', 'Live'), ('draining', 'Draining'), ('dead', 'Dead'), ('stopped', 'Stopped')], default='live', max_length=10),
        ),
        migrations.AddConstraint(
            model_name='agent',
            constraint=models.UniqueConstraint(condition=models.Q(('state__in', ['live', 'draining'])), fields=('tenant', 'name'), name='uniq_live_agent_name'),
        ),
    ]

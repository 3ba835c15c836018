"""Every limit change is audited: byte counts (storage_quota_bytes) fit, and a note holds
a person's free-text reason plus a clamp's cause."""

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('fleet', '0011_schedules'),
    ]

    operations = [
        migrations.AlterField(
            model_name='fleetchange',
            name='new_value',
            field=models.BigIntegerField(blank=True, null=True),
        ),
        migrations.AlterField(
            model_name='fleetchange',
            name='note',
            field=models.CharField(blank=True, default='', max_length=500),
        ),
        migrations.AlterField(
            model_name='fleetchange',
            name='old_value',
            field=models.BigIntegerField(blank=True, null=True),
        ),
    ]

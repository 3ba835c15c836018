# Unconfirmed pushes of a packet to its current agent (issue: a re-push is bounded).

from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('fleet', '0006_routing'),
    ]

    operations = [
        migrations.AddField(
            model_name='deliveryoutbox',
            name='redeliveries',
            field=models.PositiveIntegerField(default=0, db_default=0),
        ),
    ]

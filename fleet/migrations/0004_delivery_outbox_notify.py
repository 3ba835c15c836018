"""delivery_outbox: the NOTIFY that wakes the relays, and the reclaim history column."""

from django.db import migrations, models

# Fires after commit for every row that becomes pending (insert, redelivery, reclaim):
# the payload is the agent id, so only the relay holding that agent's socket acts on it.
NOTIFY_SQL = """
CREATE OR REPLACE FUNCTION delivery_outbox_notify() RETURNS trigger AS $$
BEGIN
    IF NEW.state = 'pending' AND (
        TG_OP = 'INSERT'
        OR OLD.state IS DISTINCT FROM NEW.state
        OR OLD.agent_id IS DISTINCT FROM NEW.agent_id
    ) THEN
        PERFORM pg_notify('delivery_outbox', NEW.agent_id::text);
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;

DROP TRIGGER IF EXISTS delivery_outbox_notify ON delivery_outbox;
CREATE TRIGGER delivery_outbox_notify
    AFTER INSERT OR UPDATE OF state, agent_id ON delivery_outbox
    FOR EACH ROW EXECUTE FUNCTION delivery_outbox_notify();
"""

DROP_SQL = """
DROP TRIGGER IF EXISTS delivery_outbox_notify ON delivery_outbox;
DROP FUNCTION IF EXISTS delivery_outbox_notify();
"""


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0003_outbox_received_at"),
    ]

    operations = [
        migrations.AddField(
            model_name="deliveryoutbox",
            name="former_agents",
            field=models.JSONField(blank=True, default=list),
        ),
        migrations.RunSQL(NOTIFY_SQL, DROP_SQL),
    ]

"""The relays' NOTIFY trigger on ``delivery_outbox`` runs only for rows that become pending.

The trigger (migration 0004) fired after every insert and every update of ``state`` or
``agent_id``: twice per packet on the hot path (the placement's insert, the outcome's ack),
each time queueing an after-trigger event, fetching the row again at the statement's end
and calling the PL/pgSQL function — which then did nothing, since its first test is
``NEW.state = 'pending'`` and a placed packet of a local agent is ``delivered``, an acked
one ``acked``.  The same test as the trigger's ``WHEN`` is checked as the row is written,
and a row that fails it queues nothing.  The function is unchanged, and so is every NOTIFY:
a row that becomes pending still passes the ``WHEN`` and the function decides as before.
Measured in isolation (docs/performance.md, "Round i17-cpu (session 16)").
"""

from django.db import migrations

TRIGGER = """
DROP TRIGGER IF EXISTS delivery_outbox_notify ON delivery_outbox;
CREATE TRIGGER delivery_outbox_notify
    AFTER INSERT OR UPDATE OF state, agent_id ON delivery_outbox
    FOR EACH ROW {when}EXECUTE FUNCTION delivery_outbox_notify();
"""


class Migration(migrations.Migration):
    dependencies = [("fleet", "0020_fillfactor_for_hot_updates")]

    operations = [
        migrations.RunSQL(
            TRIGGER.format(when="WHEN (NEW.state = 'pending') "),
            reverse_sql=TRIGGER.format(when=""),
        )
    ]

"""An agent that registers on its delivery socket is inserted already connected
(``connection_generation`` 1: fleet/executors/fleet/lifecycle.py, ``register``), with no
UPDATE of the row after it.  The event trigger counts that connect on the INSERT, so the
``connect`` counter on /metrics keeps counting every socket an agent opens."""

from django.db import migrations

FUNCTION = """
CREATE OR REPLACE FUNCTION agents_agent_events() RETURNS trigger AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        PERFORM agent_event_count('state_change', 'new', NEW.state);
        {insert_connect}
        RETURN NEW;
    END IF;
    IF OLD.state IS DISTINCT FROM NEW.state THEN
        PERFORM agent_event_count('state_change', OLD.state, NEW.state);
    END IF;
    IF NEW.connection_generation > OLD.connection_generation THEN
        PERFORM agent_event_count('connect', '', '');
    END IF;
    IF OLD.connected_to <> '' AND NEW.connected_to = '' THEN
        PERFORM agent_event_count('disconnect', '', '');
    END IF;
    RETURN NEW;
END;
$$ LANGUAGE plpgsql;
"""

INSERT_CONNECT = """IF NEW.connection_generation > 0 THEN
            PERFORM agent_event_count('connect', '', '');
        END IF;"""


class Migration(migrations.Migration):
    dependencies = [
        ("fleet", "0018_drop_redundant_and_unused_indexes"),
    ]

    operations = [
        migrations.RunSQL(
            FUNCTION.format(insert_connect=INSERT_CONNECT),
            reverse_sql=FUNCTION.format(insert_connect=""),
        ),
    ]

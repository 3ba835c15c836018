"""Room on each page for the hot tables' updates to stay on their page (HOT).

A packet's row is written three times (inserted, confirmed ``received_at``, acked) and a
task's row three or four times (inserted, claimed, given its agent, finished).  The
confirmation and the agent change no indexed column, so they could be heap-only (HOT)
updates, which write no index entry at all — but only if the row's page has room for
the new version.  At the default fillfactor (100) the pages are full when the update
comes, so the new version goes to another page and every index of the table gets an
entry.  Measured on fleetbench's drain (docs/performance.md, "Round i17-db"): HOT updates
of delivery_outbox 16–22 % → 51–52 %, of fleet_taskexecution 21–22 % → 30 %; WAL per task
−15 %.  ``ALTER TABLE … SET (fillfactor)`` takes a brief SHARE UPDATE EXCLUSIVE lock and
rewrites nothing: pages written from now on keep the room.
"""

from django.db import migrations

SET = """
ALTER TABLE delivery_outbox SET (fillfactor = 50);
ALTER TABLE fleet_taskexecution SET (fillfactor = 70);
"""
RESET = """
ALTER TABLE delivery_outbox RESET (fillfactor);
ALTER TABLE fleet_taskexecution RESET (fillfactor);
"""


class Migration(migrations.Migration):
    dependencies = [("fleet", "0019_count_connect_on_insert")]

    operations = [migrations.RunSQL(SET, RESET)]

"""agents_agent.fallback_score: the selection's fallback score, computed when metrics change.

(100 − CPU%) + free-memory%, each clamped to 0..100 and 50 when the agent reports none
(fleet/routing/selectors.py).  A stored generated column: every reservation ranks the
candidates by it, and reading it is much cheaper than taking the metrics JSON apart for
every candidate of every dispatch.  Django's model does not declare it (raw SQL reads it).
"""

from django.db import migrations


def _pct(key: str) -> str:
    return (
        f"LEAST(100.0, GREATEST(0.0, coalesce(CASE WHEN jsonb_typeof(metrics -> '{key}') = 'number'"
        f" THEN (metrics ->> '{key}')::numeric END, 50.0)))"
    )


ADD = f"""
ALTER TABLE agents_agent ADD COLUMN fallback_score double precision
    GENERATED ALWAYS AS (({_pct('free_cpu_pct')} + {_pct('memory_free_pct')})::float8) STORED;
"""
DROP = "ALTER TABLE agents_agent DROP COLUMN IF EXISTS fallback_score;"


class Migration(migrations.Migration):
    dependencies = [("agents", "0003_agent_routing")]

    operations = [migrations.RunSQL(ADD, DROP)]

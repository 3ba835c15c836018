"""Cron schedules of workflows: the firing tick, the policies, CRUD and package-declared
schedules (docs/schedules.md)."""

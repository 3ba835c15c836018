"""Slot accounting and outbox state: the fleet's bottom layer (ledger.py)."""

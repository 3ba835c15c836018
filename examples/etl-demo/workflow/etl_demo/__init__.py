"""The etl-demo example workflow (see steps.py)."""

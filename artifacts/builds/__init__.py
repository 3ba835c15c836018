"""Per-target builds made in the background of `serve`."""

"""The package REST endpoints (/packages, /artifacts, /builds)."""

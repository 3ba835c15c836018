"""The package store: validate, build, store and look up workflow packages."""

"""Tenancy and configuration: what every layer of the server stands on."""

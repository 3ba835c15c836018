"""A URL conf with no paths (tests: a path resolved under another URL conf)."""

urlpatterns: list = []

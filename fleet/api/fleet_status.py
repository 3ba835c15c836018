"""REST endpoints (mounted under /api/v1 by cloacina_site.api)."""

from ninja import Router

router = Router()

"""WebSocket routes (the agent delivery socket)."""

websocket_urlpatterns: list = []

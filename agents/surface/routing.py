"""WebSocket routes: the agents' delivery socket (``ws_path`` in the registration answer)."""

from django.urls import path

from agents.surface.consumers import AgentDeliveryConsumer

websocket_urlpatterns: list = [
    path("ws/agents/<str:agent_id>/", AgentDeliveryConsumer.as_asgi()),
]

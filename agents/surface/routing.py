"""WebSocket routes: the agents' delivery socket (``ws_path`` in the registration answer),
and the socket an agent registers on (``/ws/agents/``)."""

from django.urls import path

from agents.surface.consumers import AgentDeliveryConsumer

websocket_urlpatterns: list = [
    # Register on the socket, then deliver (docs/agent-protocol.md).
    path("ws/agents/", AgentDeliveryConsumer.as_asgi()),
    path("ws/agents/<str:agent_id>/", AgentDeliveryConsumer.as_asgi()),
]

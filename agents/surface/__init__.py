"""What agents reach: the REST endpoints and the delivery WebSocket."""

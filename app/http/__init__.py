"""The HTTP edge: the proxy port (a plain ASGI application), the admin port (FastAPI), and the
server that runs both."""

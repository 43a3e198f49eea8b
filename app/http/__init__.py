"""The HTTP edge: FastAPI applications for the proxy port (and, later, the admin port)."""

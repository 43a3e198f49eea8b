"""The HTTP edge: the proxy port (a plain ASGI application, `proxy`), the admin port (FastAPI:
`admin`, `ui`), the composition root that builds the runtime both share (`runtime`), and the
server that runs both under uvicorn (`server`)."""

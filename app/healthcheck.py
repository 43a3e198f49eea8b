"""`python -m oncegate.healthcheck`: the container image's health check, at the path the
Dockerfile and docs/operations.md give. It lives in oncegate.commands.healthcheck."""

import sys

from .commands.healthcheck import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())

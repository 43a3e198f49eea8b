"""`python -m oncegate.cli`: the `oncegate` command at the path scripts, benchmarks and older
installs name. The command lives in oncegate.commands.cli."""

import sys

from .commands.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())

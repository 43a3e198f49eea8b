"""The commands: `oncegate` and its subcommands, the container's health check, the demo upstream.
The top floor: each command builds what it runs from settings; nothing below imports a command."""

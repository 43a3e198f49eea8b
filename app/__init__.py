"""oncegate: an Idempotency-Key gateway. This folder installs as the `oncegate` package."""

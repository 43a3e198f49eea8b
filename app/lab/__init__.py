"""The demo upstream, and the crash-recovery lab that shows why an agent needs both checkpoints
and idempotency keys."""

"""The demo upstream (`demo_upstream`), and the crash-recovery lab that shows why an agent needs
both checkpoints and idempotency keys: the 12-step task (`task`), the services it runs against
(`stack`: PostgreSQL, a gateway, the demo upstream), the runs and their table (`crashlab`) and
the SVG chart (`plot`)."""

"""The crash-recovery lab (`oncegate lab`, whose command is commands/lab.py) that shows why an
agent needs both checkpoints and idempotency keys: the 12-step task (`task`), the services it
runs against (`stack`: PostgreSQL, a gateway, the demo upstream), the strategies and crashes
(`model`), the process that plays a run (`worker`), the lab that kills and resumes the runs
(`crashlab`), their figures and table (`report`) and the SVG chart (`plot`)."""

"""The chaos soak and its history checker: `python -m tests.soak`, `make soak`.

- `driver`: starts PostgreSQL, the recording upstream, three gateways and a fuzzing gateway;
  runs the clients while it kills gateways and PostgreSQL; heals; hands the histories over.
- `upstream`: the recording upstream (its own process; an fsync'ed log of what it performed).
- `fuzz`: hypothesis-drawn raw requests at a gateway (its own process).
- `checker`: the rules, a pure function of the histories; `history`: their JSON Lines files.
"""

"""The request kernel: the rules a request is held to, as pure functions and values (its key,
its fingerprint, its headers and path, a stored answer's sealing). No I/O but the key workers'
processes; imports only the model."""

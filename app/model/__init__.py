"""The domain model: the values the gateway talks about (how a request was answered, the
problems it can say, an agent's checkpoint). Imports nothing of oncegate's."""

"""A small client library for agents that must survive a crash without repeating a side effect.

Recovery needs two parts (see the lab, `oncegate lab`):

- a checkpoint after every step (`checkpoints.Checkpoint`, saved through a `CheckpointStore`;
  `oncegate.store.checkpoints.PostgresCheckpoints` is the PostgreSQL one), so a restarted run
  resumes where it stopped with the earlier outputs in hand (`runner.run_agent`);
- an idempotency key on every action, derived from the run and the step (`keys.action_key`,
  `run-81:step-10:charge`), sent through the gateway (`client.ActionClient`), so the one action
  that was sent but not yet checkpointed when the process died is replayed, not performed again.

On LangGraph (the extra `oncegate[langgraph]`), LangGraph's own checkpointer does the first part
and `langgraph.task_key` / `langgraph.Gateway` the second: the key comes from the task LangGraph
runs, the same on every resume of it (derived in `langgraph_keys`, whose docstring states the
rules). Nothing else in oncegate imports LangGraph.

This package does no I/O of its own on PostgreSQL: it talks to it through the `CheckpointStore`
Protocol, and only `oncegate.store` imports the driver.
"""

"""Whether the running task is out of its client's reach.

The service runs each keyed request's claim, forward and settle in a task of its own, shielded
from the request (`service.flow`): a client that hangs up, or a caller that cancels, stops
waiting for it but never cancels it. It says so in that task's context (`SHIELDED`, set in the
task's own copy, so nothing outside the task sees it). The store reads it: a lone statement of
such a task can be sent in that task, where a cancellation that cannot reach it cannot cut it
short (`store.batching.Batcher.run`); any other caller's waits in a task of the store's own.
"""

from __future__ import annotations

from contextvars import ContextVar

SHIELDED: ContextVar[bool] = ContextVar("oncegate_shielded", default=False)

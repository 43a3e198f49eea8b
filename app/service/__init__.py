"""The gateway's service: the state machine of contract sections 4 and 5, and the operator's
side of the keys. No web framework and no database driver: the edge (`http/`) calls it, and it
reaches PostgreSQL through its ports (`ports`) and the upstream through its client.

One idea per room, each readable top to bottom:
- `flow`: `Gateway.handle`, claim -> forward -> settle (start here);
- `waiting`: `Prefer: wait=N`, a request that waits for a key in flight to settle;
- `decision`: `decide`, pure: what to do with a key someone claimed before;
- `operator`: `Operator`, the operator's queue, its cursors, release, resolve and re-send;
- `evidence`: the request kept behind a key, and what its gateway saw when it turned `unknown`;
- `maintenance`: the purger and the key count behind `oncegate_keys`;
- `health`: whether the gateway can serve (`/readyz`);
- `messages`: what the edge hands the gateway and gets back;
- `ports`: what the service needs of the key store, one Protocol per consumer;
- `routing`, `tokens`: which route a path takes, and a key's scope from a verified JWT.

The names others use are imported here, so `from oncegate import service` is all a caller needs.
"""

from .decision import (
    IN_PROGRESS_RETRY_AFTER,
    Decision,
    InFlight,
    Reclaim,
    Refuse,
    Replay,
    TakeOver,
    decide,
)
from .flow import CLAIM_ATTEMPTS, Gateway
from .health import Health, Readiness
from .maintenance import (
    KEY_COUNT_PAGE_SIZE,
    PURGE_BATCH_SIZE,
    PURGE_PAUSE,
    count_keys,
    purge_expired,
)
from .messages import Answer, ClientGoneProbe, ProxyRequest
from .operator import QUEUE_PAGE_SIZE, Operator, QueuePage, decode_cursor, encode_cursor
from .ports import OperatorStore, RequestStore, UpkeepStore
from .waiting import ClientGone

__all__ = [
    "CLAIM_ATTEMPTS",
    "IN_PROGRESS_RETRY_AFTER",
    "KEY_COUNT_PAGE_SIZE",
    "PURGE_BATCH_SIZE",
    "PURGE_PAUSE",
    "QUEUE_PAGE_SIZE",
    "Answer",
    "ClientGone",
    "ClientGoneProbe",
    "Decision",
    "Gateway",
    "Health",
    "InFlight",
    "Operator",
    "OperatorStore",
    "ProxyRequest",
    "QueuePage",
    "Readiness",
    "Reclaim",
    "Refuse",
    "Replay",
    "RequestStore",
    "TakeOver",
    "UpkeepStore",
    "count_keys",
    "decide",
    "decode_cursor",
    "encode_cursor",
    "purge_expired",
]

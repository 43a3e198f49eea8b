"""The one renderer of gateway errors: RFC 9457 problem details."""

from __future__ import annotations

import json
from email.utils import formatdate

from starlette.responses import Response

from app import errors

MEDIA_TYPE = "application/problem+json"


def render(error: errors.GatewayError) -> Response:
    return Response(
        content=json.dumps(error.problem()),
        status_code=error.status_code,
        media_type=MEDIA_TYPE,
        # The server's own Date header is off (proxied answers carry the upstream's); the
        # gateway's own answers carry one, as RFC 9110 §6.6.1 asks of a server with a clock.
        headers={**error.headers, "Date": formatdate(usegmt=True)},
    )

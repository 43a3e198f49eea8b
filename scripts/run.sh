#!/usr/bin/env bash
# `make run`: the demo upstream, then the gateway in front of it on the embedded PostgreSQL.
# Either one that cannot start stops both, with a message: a gateway in front of whatever else
# holds the demo's port would store that program's answers as if they were the demo's.
# Ctrl-C stops both. Ports: DEMO_PORT (9000), ONCEGATE_PORT (8080), ONCEGATE_ADMIN_PORT (8081).
set -u
bin=${VENV:-.venv}/bin
demo_port=${DEMO_PORT:-9000}
port=${ONCEGATE_PORT:-8080}
admin_port=${ONCEGATE_ADMIN_PORT:-8081}
# A terminal reads text better; ONCEGATE_LOG_FORMAT=json make run still gives JSON.
export ONCEGATE_LOG_FORMAT=${ONCEGATE_LOG_FORMAT:-text}
# The admin API needs a token; a fresh one per run unless one is given.
export ONCEGATE_ADMIN_TOKEN=${ONCEGATE_ADMIN_TOKEN:-$("$bin/python" -c 'import secrets; print("dev-" + secrets.token_urlsafe(12))')}

answers() {  # does something answer HTTP GET $1 with a 2xx?
    "$bin/python" - "$1" <<'PYTHON'
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=1) as answer:
        sys.exit(0 if answer.status < 300 else 1)
except Exception:
    sys.exit(1)
PYTHON
}

listening() {  # does anything accept connections on 127.0.0.1:$1?
    "$bin/python" -c "import socket, sys; socket.create_connection(('127.0.0.1', $1), 1).close()" 2>/dev/null
}

if listening "$demo_port"; then
    echo "make run: port $demo_port is already in use, so the demo upstream cannot start there." >&2
    echo "make run: stop the program that holds it, or choose another: make run DEMO_PORT=9100" >&2
    exit 1
fi
"$bin/oncegate" demo-upstream --port "$demo_port" &
demo=$!
trap 'kill "$demo" 2>/dev/null; wait "$demo" 2>/dev/null' EXIT
trap 'exit 130' INT TERM
until answers "http://127.0.0.1:$demo_port/actions"; do
    if ! kill -0 "$demo" 2>/dev/null; then
        echo "make run: the demo upstream did not start (above); the gateway was not started." >&2
        exit 1
    fi
    sleep 0.1
done

cat >&2 <<TEXT
make run: the admin API's token for this run is $ONCEGATE_ADMIN_TOKEN
          curl -s -H 'Authorization: Bearer $ONCEGATE_ADMIN_TOKEN' 'localhost:$admin_port/admin/keys?key=order-81'
TEXT
# In the foreground: Ctrl-C reaches it from the terminal, and it stops as on SIGTERM.
"$bin/oncegate" serve --upstream "http://127.0.0.1:$demo_port" --port "$port" \
    --admin-port "$admin_port"
status=$?
if [ "$status" -ne 0 ] && [ "$status" -lt 128 ]; then
    echo "make run: the gateway did not start or stopped with status $status (above)." >&2
fi
exit "$status"

# oncegate as a container: `docker build -t oncegate .`, then see docker-compose.yml.
#
# The database comes from ONCEGATE_DATABASE_URL (run `oncegate migrate` once against it). The image
# has no embedded PostgreSQL: a container should not keep its database inside itself, and
# pgserver's binaries are 34 MB that no container uses. Without ONCEGATE_DATABASE_URL, `serve`
# stops with a message saying so.
#
# Reproducible: the base image is pinned to a Python release and a Debian release (pin its digest
# too, `python:3.11.11-slim-bookworm@sha256:...`, where a registry can be asked for it), and the
# dependencies are installed from requirements.lock, every version pinned and every file checked
# against its hash (`make lock` writes it from pyproject.toml).
FROM python:3.11.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src

# Dependencies first, in a layer of their own: it is rebuilt only when the lock changes, not on
# every change to app/. pgserver is left out of the lock on purpose (see above).
COPY requirements.lock ./
RUN pip install --require-hashes --no-deps -r requirements.lock

# The package itself (app/ installs as `oncegate`, with migrations/ inside it); its dependencies
# are already there.
COPY pyproject.toml README.md ./
COPY app/ app/
COPY migrations/ migrations/
RUN pip install --no-deps . && rm -rf build oncegate.egg-info

# An unprivileged user, with a home of its own.
RUN groupadd --system --gid 10001 oncegate \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /var/lib/oncegate oncegate
WORKDIR /var/lib/oncegate
# Numeric, so that a runtime can tell it is not root without looking the name up (runAsNonRoot).
USER 10001:10001

# 8080: the proxy; 8081: the admin port (/metrics, /healthz, /readyz, admin API).
EXPOSE 8080 8081

# GET /healthz on the admin port the gateway was given: its --admin-port flag (read from the
# command line of the container's first process), else ONCEGATE_ADMIN_PORT, else 8081.
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["python", "-m", "oncegate.healthcheck"]

ENTRYPOINT ["oncegate"]
CMD ["serve", "--host", "0.0.0.0"]

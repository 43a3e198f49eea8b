# oncegate as a container: `docker build -t oncegate .`, then see docker-compose.yml.
#
# The database comes from ONCEGATE_DATABASE_URL (run `oncegate migrate` once against it). pgserver,
# the embedded PostgreSQL, is a core dependency and so is installed too, but a container should
# not keep its database inside itself: without ONCEGATE_DATABASE_URL, `serve` would start one
# under ONCEGATE_DATA_DIR, which is lost with the container.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src

# Dependencies first, in a layer of their own: it is rebuilt only when pyproject.toml changes,
# not on every change to app/. They are read from pyproject.toml and installed without the package.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt

# The package itself (app/ installs as `oncegate`, with migrations/ inside it); its dependencies
# are already there.
COPY README.md ./
COPY app/ app/
COPY migrations/ migrations/
RUN pip install --no-deps . && rm -rf build oncegate.egg-info

# An unprivileged user; its home holds ONCEGATE_DATA_DIR should anyone run the embedded default.
RUN groupadd --system --gid 10001 oncegate \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /var/lib/oncegate oncegate
WORKDIR /var/lib/oncegate
ENV ONCEGATE_DATA_DIR=/var/lib/oncegate/data
# Numeric, so that a runtime can tell it is not root without looking the name up (runAsNonRoot).
USER 10001:10001

# 8080: the proxy; 8081: the admin port (/metrics, /healthz, /readyz, admin API).
EXPOSE 8080 8081

# slim has no curl: python's urllib. urlopen raises on anything but 2xx, so any failure exits 1.
HEALTHCHECK --interval=10s --timeout=3s --start-period=15s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('ONCEGATE_ADMIN_PORT', '8081') + '/healthz', timeout=2)"]

ENTRYPOINT ["oncegate"]
CMD ["serve", "--host", "0.0.0.0"]

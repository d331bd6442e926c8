# The reaper daemon: harvests a PostgreSQL outbox into Kafka.
#   docker build -t "$REGISTRY/outbox-harvester/reaper:0.1.0" .   # the image deploy/k8s/ names, to push
#   docker run --rm -v $PWD/reaper.yaml:/etc/reaper/reaper.yaml:ro -p 9090:9090 "$REGISTRY/outbox-harvester/reaper:0.1.0"
# Configuration: /etc/reaper/reaper.yaml (mount it), REAPER_* environment overrides, secrets as
# ${env:NAME} or ${file:/path}; see docs/reaper.md. Metrics and probes on port 9090.
# TLS: HOME is /nonexistent, so libpq finds no ~/.postgresql/root.crt or ~/.pgpass: mount the CA bundle
# (e.g. at /etc/reaper-tls/ca.crt) and name it in sslrootcert= and ssl.ca.location; see docs/security.md.

# The base image: a tag, and the digest it must resolve to. Pin the digest for a reproducible build
# (docs/reaper.md shows how to find it):
#   docker build --build-arg PYTHON_DIGEST=sha256:<digest of python:3.11-slim-bookworm> ...
# Left empty, the build takes whatever the tag points to today.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG PYTHON_DIGEST=
# --build-arg OTEL=1 adds the otel extra (opentelemetry-api, hashed in requirements-otel.lock): the
# reaper then records a publish span per batch when the process has a tracer provider (docs/client.md).
ARG OTEL=0
# --build-arg REVISION=$(git rev-parse HEAD) names the commit in the image's labels.
ARG REVISION=

# ---- build: the locked dependencies and the package, in a virtualenv without pip or setuptools
FROM ${PYTHON_IMAGE}${PYTHON_DIGEST:+@}${PYTHON_DIGEST} AS build
ARG OTEL
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /src
# Every Python dependency, and the build backend, comes from a lock file with hashes (pip-compile; see
# the header of each for the command that regenerates it): no Python package resolves at build time.
# The C compiler and librdkafka's headers (below) are the base image's Debian release's.
COPY requirements.lock requirements-build.lock requirements-otel.lock ./
# README.md is left out on purpose: the image needs no long description, and the build must not depend on it.
# setup.py maps the top-level sql/ (the migrations) into the wheel as harvester/postgres/sql/.
COPY pyproject.toml setup.py ./
# LICENSE is pyproject.toml's license-files: the wheel ships it (setuptools only warns when it is missing, for now).
COPY LICENSE ./
COPY leader/ leader/
COPY harvester/ harvester/
COPY sql/ sql/
# /opt/build holds the tools (pip, the locked setuptools) that build the wheel; /opt/reaper gets only the
# locked dependencies and that wheel, installed by /opt/build's pip from outside (--python).
# confluent-kafka and psycopg[binary] ship manylinux wheels (librdkafka and libpq inside); the compiler
# and librdkafka's headers (Debian's, in this stage only) build the native modules: the log source's
# insert decoder, and the producer process's loop against the wheel's librdkafka (deploy/native/build.sh;
# docs/log-source.md).
COPY deploy/native/ deploy/native/
RUN apt-get update \
 && apt-get install --yes --no-install-recommends gcc libc6-dev librdkafka-dev \
 && python -m venv /opt/build \
 && /opt/build/bin/pip install --require-hashes -r requirements-build.lock \
 && /opt/build/bin/pip wheel --no-deps --no-build-isolation --wheel-dir /wheels /src \
 && python -m venv --without-pip /opt/reaper \
 && /opt/build/bin/pip --python /opt/reaper/bin/python install --require-hashes -r requirements.lock \
 && if [ "$OTEL" = 1 ]; then /opt/build/bin/pip --python /opt/reaper/bin/python install --require-hashes --no-deps -r requirements-otel.lock; fi \
 && /opt/build/bin/pip --python /opt/reaper/bin/python install --no-deps --no-index --find-links /wheels outbox-harvester \
 && bash deploy/native/build.sh /opt/reaper/bin/python \
 && /opt/reaper/bin/reaper --version

# ---- runtime: the virtualenv only, run as an unprivileged user
FROM ${PYTHON_IMAGE}${PYTHON_DIGEST:+@}${PYTHON_DIGEST}
ARG REVISION
# The OCI annotations (pyproject.toml's version, license and URLs; tests/reaper/test_dockerfile.py keeps them equal).
LABEL org.opencontainers.image.title="outbox-harvester reaper" \
      org.opencontainers.image.description="Transactional outbox harvester: PostgreSQL to Kafka" \
      org.opencontainers.image.version="0.1.0" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.url="https://github.com/outbox-harvester/outbox-harvester" \
      org.opencontainers.image.source="https://github.com/outbox-harvester/outbox-harvester" \
      org.opencontainers.image.documentation="https://github.com/outbox-harvester/outbox-harvester/blob/main/docs/reaper.md"
# Nothing installs packages at run time: the base image's own pip (and setuptools and wheel, where the
# tag still ships them) goes, with ensurepip's bundled copies: scanners flag them.
RUN python -m pip uninstall --yes pip setuptools wheel \
 && rm -rf /usr/local/lib/python3.*/ensurepip/_bundled \
 && groupadd --system --gid 10001 reaper \
 && useradd --system --uid 10001 --gid reaper --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin reaper \
 && mkdir -p /etc/reaper
COPY --from=build /opt/reaper /opt/reaper
ENV PATH=/opt/reaper/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    REAPER_CONFIG=/etc/reaper/reaper.yaml
USER 10001:10001
EXPOSE 9090
# /healthz answers 200 while every harvester thread runs, 503 once one has died; the port follows
# REAPER_HTTP__PORT when that is set.
HEALTHCHECK --interval=15s --timeout=5s --start-period=30s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('REAPER_HTTP__PORT', '9090'), timeout=4)"]
ENTRYPOINT ["reaper"]
CMD ["run"]

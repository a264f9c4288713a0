# syntax=docker/dockerfile:1
#
# Inferplane control plane image: one image for every app process.
#   web     (default CMD)  scripts/web.sh (uvicorn controlplane.asgi:application)
#   worker                 celery -A controlplane worker -Q celery -l info
#   worker-adapters        celery -A controlplane worker -Q adapters -n adapters@%h -l info
#   beat                   celery -A controlplane beat -l info --schedule /tmp/celerybeat-schedule
#   migrate                python manage.py migrate --noinput
# The vLLM engines run the upstream vllm/vllm-openai image, not this one.
#
# Build:  docker build -t inferplane:local .

ARG PYTHON_VERSION=3.12

# --- build: a virtualenv holding the dependencies and the project ---------------------------
FROM python:${PYTHON_VERSION}-slim AS build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

WORKDIR /src

# Dependencies first, from pyproject.toml alone, so that a code change does not reinstall
# them (every dependency ships manylinux wheels: no compiler needed).
COPY pyproject.toml ./
RUN --mount=type=cache,target=/root/.cache/pip \
    python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt

COPY README.md manage.py ./
COPY contract ./contract
COPY controlplane ./controlplane
COPY tenants ./tenants
COPY fleet ./fleet
COPY conversations ./conversations
COPY adapters ./adapters
COPY inference ./inference
COPY batches ./batches
COPY billing ./billing
COPY moderation ./moderation
COPY dashboard ./dashboard
COPY templates ./templates
RUN --mount=type=cache,target=/root/.cache/pip \
    pip install --no-deps .

# --- runtime --------------------------------------------------------------------------------
FROM python:${PYTHON_VERSION}-slim AS runtime

# PYTHONPATH=/app: the code runs from /app (templates/ and var/ sit beside the packages, which
# is where settings.BASE_DIR points), and uvicorn, celery and manage.py all import the same copy.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONPATH=/app \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    INFERPLANE_ENV=production \
    INFERPLANE_VAR_DIR=/app/var \
    WEB_CONCURRENCY=2

RUN groupadd --system --gid 10001 inferplane \
    && useradd --system --uid 10001 --gid inferplane --home-dir /app --no-create-home \
        --shell /usr/sbin/nologin inferplane

COPY --from=build /opt/venv /opt/venv

WORKDIR /app
COPY manage.py pyproject.toml ./
COPY contract ./contract
COPY controlplane ./controlplane
COPY tenants ./tenants
COPY fleet ./fleet
COPY conversations ./conversations
COPY adapters ./adapters
COPY inference ./inference
COPY batches ./batches
COPY billing ./billing
COPY moderation ./moderation
COPY dashboard ./dashboard
COPY templates ./templates
COPY scripts/web.sh scripts/uvicorn-json-logging.json ./scripts/

# Static files are collected at build time (whitenoise serves them, hashed and compressed).
# Production settings refuse to load without SECRET_KEY and ALLOWED_HOSTS: the values here are
# throwaway build-time placeholders, set for this one command only and absent from the image.
RUN SECRET_KEY=collectstatic-build-only ALLOWED_HOSTS=localhost \
        python manage.py collectstatic --noinput \
    && python -m compileall -q contract controlplane tenants conversations fleet adapters inference batches billing moderation \
    && mkdir -p /app/var/media \
    && chown inferplane:inferplane /app/var /app/var/media

USER 10001:10001
EXPOSE 8000

# Workers: $WEB_CONCURRENCY (uvicorn reads it as the default for --workers; with more than one,
# scripts/web.sh sets up the metrics' multiprocess directory under /tmp).
# Health: GET /healthz. In production Django redirects plain HTTP to HTTPS, so probes send
# "X-Forwarded-Proto: https" and a Host that is in ALLOWED_HOSTS.
CMD ["scripts/web.sh", "--host", "0.0.0.0", "--port", "8000"]

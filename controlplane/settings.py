"""Django settings for Inferplane, read from the environment (see docs/configuration.md).

Two modes: ``INFERPLANE_ENV=development`` (the default; what ``make run`` and the tests use)
works with no configuration at all; ``INFERPLANE_ENV=production`` refuses to start without a
real ``SECRET_KEY`` and ``ALLOWED_HOSTS`` and turns on every HTTPS protection, so that
``manage.py check --deploy`` reports nothing.
"""

from __future__ import annotations

import re
import secrets
from datetime import timedelta
from pathlib import Path
from typing import Any

import django_stubs_ext
from celery.schedules import crontab
from django.core.exceptions import ImproperlyConfigured
from django.utils.csp import CSP

from controlplane.env import (
    env_bool,
    env_choice,
    env_database,
    env_int,
    env_list,
    env_str,
)

# Lets Django's generic classes be subscripted at run time (ModelAdmin[Tenant]) for mypy.
django_stubs_ext.monkeypatch()

BASE_DIR = Path(__file__).resolve().parent.parent
VAR_DIR = Path(env_str("INFERPLANE_VAR_DIR", str(BASE_DIR / "var")))

INFERPLANE_ENV = env_choice("INFERPLANE_ENV", "development", {"development", "production"})
PRODUCTION = INFERPLANE_ENV == "production"
DEBUG = env_bool("DEBUG", False)
if PRODUCTION and DEBUG:
    # DEBUG shows settings and stack traces to anyone who triggers an error.
    raise ImproperlyConfigured("DEBUG must be off when INFERPLANE_ENV=production")


def _secret_key() -> str:
    """The key from the environment; in development, one generated once into ``var/``."""
    key = env_str("SECRET_KEY", "")
    if key:
        return key
    if PRODUCTION:
        raise ImproperlyConfigured("SECRET_KEY must be set when INFERPLANE_ENV=production")
    path = VAR_DIR / "secret_key"
    if not path.exists():
        VAR_DIR.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600)
        path.write_text(secrets.token_urlsafe(50))
    return path.read_text().strip()


SECRET_KEY = _secret_key()

if PRODUCTION:
    ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", [])
    if not ALLOWED_HOSTS:
        raise ImproperlyConfigured("ALLOWED_HOSTS must be set when INFERPLANE_ENV=production")
else:
    ALLOWED_HOSTS = env_list("ALLOWED_HOSTS", ["localhost", "127.0.0.1", "[::1]", "testserver"])
CSRF_TRUSTED_ORIGINS = env_list("CSRF_TRUSTED_ORIGINS", [])

INSTALLED_APPS = [
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "whitenoise.runserver_nostatic",
    "django.contrib.staticfiles",
    "django.contrib.humanize",
    "rest_framework",
    "knox",
    "drf_spectacular",
    "drf_spectacular_sidecar",
    "channels",
    "axes",
    "controlplane",  # its management commands (run_drains)
    "tenants",
    "adapters",
    "fleet",
    "conversations",
    "inference",
    "batches",
    "billing",
    "moderation",
    "dashboard",
]

MIDDLEWARE = [
    "django.middleware.security.SecurityMiddleware",
    "django.middleware.csp.ContentSecurityPolicyMiddleware",
    "whitenoise.middleware.WhiteNoiseMiddleware",
    "django.contrib.sessions.middleware.SessionMiddleware",
    "django.middleware.common.CommonMiddleware",
    "django.middleware.csrf.CsrfViewMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
    "django.contrib.messages.middleware.MessageMiddleware",
    "django.middleware.clickjacking.XFrameOptionsMiddleware",
    # Last, as django-axes asks: turns a locked-out login into its 429 page.
    "axes.middleware.AxesMiddleware",
]

ROOT_URLCONF = "controlplane.urls"
ASGI_APPLICATION = "controlplane.asgi.application"
WSGI_APPLICATION = "controlplane.wsgi.application"

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
                "django.template.context_processors.csp",
            ],
        },
    },
]

# --- Data stores -------------------------------------------------------------------------

DATABASES = {
    "default": env_database("DATABASE_URL", f"sqlite:///{VAR_DIR / 'inferplane.sqlite3'}"),
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Several processes (web, worker, beat) share the file: WAL lets readers run beside
    # the writer, IMMEDIATE makes writers queue instead of failing with "database is locked".
    DATABASES["default"]["OPTIONS"] = {
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
        "transaction_mode": "IMMEDIATE",
        "timeout": 20,
    }
    # Django's ASGI handler closes connections per request; a persistent SQLite
    # connection would gain nothing and keep the file locked longer.
    DATABASES["default"]["CONN_MAX_AGE"] = 0

REDIS_URL = env_str("REDIS_URL", "redis://127.0.0.1:6379/0")
# The data plane's state (admission, limits, keys, catalog, usage spool, response cache,
# moderation policies): REDIS_URL's Redis by default. ``redis+cluster://host:port`` (or
# ``rediss+cluster://``) names a Redis Cluster by one of its nodes: every key there carries the
# hash tag of what it belongs to (docs/scaling.md). Celery's broker and Channels stay on
# REDIS_URL: neither runs on a cluster.
STATE_REDIS_URL = env_str("STATE_REDIS_URL", REDIS_URL)
if STATE_REDIS_URL.partition("://")[0] not in (
    "redis",
    "rediss",
    "unix",
    "redis+cluster",
    "rediss+cluster",
):
    raise ImproperlyConfigured(
        "STATE_REDIS_URL must be redis://, rediss://, unix://, redis+cluster:// or "
        f"rediss+cluster://, not {STATE_REDIS_URL.partition('://')[0]}://"
    )

CACHES = {
    "default": {
        "BACKEND": "django.core.cache.backends.redis.RedisCache",
        "LOCATION": REDIS_URL,
        "KEY_PREFIX": "ip:cache",
    }
}

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [REDIS_URL], "prefix": "ip:channels"},
    }
}

# --- Celery (broker = Redis; every periodic schedule is declared here and only here) -------
# What the gateways leave in Redis for Postgres is not on this schedule: the drains process
# (``controlplane.drains``) waits on it and moves it as it comes.

CELERY_BROKER_URL = env_str("CELERY_BROKER_URL", REDIS_URL)
# On Redis, kombu's transport with one fix: a worker outlives a Redis restart (see the module).
# (rediss:// keeps kombu's own: kombu picks its TLS defaults by that scheme's transport name.)
if CELERY_BROKER_URL.startswith("redis://"):
    CELERY_BROKER_TRANSPORT = "controlplane.broker:Transport"
# An idle worker's BRPOP comes back empty every this many seconds (kombu's default, 1 s, was
# most of what an idle platform asked Redis); a message ends the wait at once either way.
CELERY_BROKER_TRANSPORT_OPTIONS = {"polling_interval": 10}
CELERY_TASK_IGNORE_RESULT = True
CELERY_TASK_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]
CELERY_TIMEZONE = "UTC"
CELERY_WORKER_HIJACK_ROOT_LOGGER = False
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True
CELERY_TASK_ALWAYS_EAGER = env_bool("CELERY_TASK_ALWAYS_EAGER", False)
# Adapter validation has a queue and a worker of its own (Procfile "worker-adapters"), so
# that uploads never hold up probes, metering and rollups on the default queue ("celery").
CELERY_TASK_ROUTES = {
    "adapters.tasks.adapter_validate_task": {"queue": "adapters"},
    # Batch work has its own queue and worker (Procfile "worker-batch"): a large batch never
    # delays probes, metering or rollups.
    "batches.tasks.batch_validate_task": {"queue": "batch"},
    "batches.tasks.batch_run_task": {"queue": "batch"},
    "batches.tasks.batch_finalize_task": {"queue": "batch"},
    # The sweep itself is quick and must not wait behind batch work: the default queue.
}
# --- Stripe --------------------------------------------------------------------------------
# Unset: invoices are still computed and finalized, but nothing is sent to Stripe and the
# webhook refuses every call.
STRIPE_API_KEY = env_str("STRIPE_API_KEY", "")
STRIPE_WEBHOOK_SECRET = env_str("STRIPE_WEBHOOK_SECRET", "")
INVOICE_DAYS_UNTIL_DUE = env_int("INFERPLANE_INVOICE_DAYS_UNTIL_DUE", 30, minimum=1)

CELERY_BEAT_SCHEDULE: dict[str, dict[str, object]] = {
    "probe-replicas": {
        "task": "inference.tasks.replicas_probe_all",
        "schedule": float(env_int("INFERPLANE_PROBE_INTERVAL_SECONDS", 10, minimum=1)),
    },
    # Rollups of the (tenant, day) pairs that got new records since the last run. The usage
    # drain rolls up what it writes every 10 s; this catches the records of other writers
    # (the reconcile command, invoicing's last flush).
    "refresh-daily-usage": {
        "task": "billing.tasks.daily_usage_refresh_task",
        "schedule": 60.0,
        "options": {"expires": 30},
    },
    # The engines' own token counters, the other side of `reconcile_usage`.
    "snapshot-engine-counters": {
        "task": "billing.tasks.counter_snapshots_take_task",
        "schedule": 60.0,
        "options": {"expires": 50},
    },
    # Last month's invoices, on the first of the month (UTC) once its usage has landed.
    "finalize-invoices": {
        "task": "billing.tasks.invoices_finalize_last_month_task",
        "schedule": crontab(minute=30, hour=0, day_of_month=1),
    },
    # The safety net: stale markers live in Redis, which keeps nothing on disk.
    "refresh-recent-daily-usage": {
        "task": "billing.tasks.daily_usage_refresh_recent_task",
        "schedule": 3600.0,
        "options": {"expires": 1800},
    },
    # Stored responses (the Responses API's) past their retention.
    "purge-stored-responses": {
        "task": "conversations.tasks.stored_responses_purge_task",
        "schedule": 3600.0,
        "options": {"expires": 1800},
    },
    # The moderation policies republished, which heals a Redis that lost them (the gateways
    # also rebuild them when they find none).
    "publish-moderation-policies": {
        "task": "moderation.tasks.moderation_policies_publish_task",
        "schedule": 60.0,
        "options": {"expires": 30},
    },
    "flush-key-last-used": {
        "task": "tenants.tasks.api_keys_last_used_flush",
        "schedule": 60.0,
        "options": {"expires": 30},
    },
    # Adapter versions still validating past INFERPLANE_ADAPTER_VALIDATION_DEADLINE_MINUTES
    # (a worker killed at the hard time limit, a lost message) get a verdict.
    # Batches: expire what is past its window, wake a worker for work nobody is doing.
    "sweep-batches": {
        "task": "batches.tasks.batches_sweep_task",
        # 15 s: each run costs the broker ~10 commands (docs/scaling.md, idle costs).
        "schedule": float(env_int("INFERPLANE_BATCH_SWEEP_SECONDS", 15, minimum=1)),
        "options": {"expires": 30},
    },
    "reject-stuck-adapters": {
        "task": "adapters.tasks.adapters_stuck_reject_task",
        "schedule": 300.0,
        "options": {"expires": 240},
    },
}

# --- Auth ----------------------------------------------------------------------------------

AUTH_USER_MODEL = "tenants.User"
# django-axes first: it refuses a locked-out login before any password is checked.
AUTHENTICATION_BACKENDS = [
    "axes.backends.AxesStandaloneBackend",
    "django.contrib.auth.backends.ModelBackend",
]
LOGIN_URL = "/app/login/"
LOGIN_REDIRECT_URL = "/app/"
LOGOUT_REDIRECT_URL = "/app/login/"
AUTH_PASSWORD_VALIDATORS = [
    {"NAME": "django.contrib.auth.password_validation.UserAttributeSimilarityValidator"},
    {"NAME": "django.contrib.auth.password_validation.MinimumLengthValidator"},
    {"NAME": "django.contrib.auth.password_validation.CommonPasswordValidator"},
    {"NAME": "django.contrib.auth.password_validation.NumericPasswordValidator"},
]

REST_FRAMEWORK = {
    # Token first: an unauthenticated call then gets 401 with "WWW-Authenticate: Token".
    "DEFAULT_AUTHENTICATION_CLASSES": [
        "knox.auth.TokenAuthentication",
        "rest_framework.authentication.SessionAuthentication",
    ],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_SCHEMA_CLASS": "controlplane.api.AutoSchema",
    "DEFAULT_PAGINATION_CLASS": "rest_framework.pagination.LimitOffsetPagination",
    "PAGE_SIZE": 50,
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"]
    + ([] if PRODUCTION else ["rest_framework.renderers.BrowsableAPIRenderer"]),
    "UNAUTHENTICATED_USER": None,
    "EXCEPTION_HANDLER": "controlplane.api.exception_handler",
}

REST_KNOX = {
    "TOKEN_TTL": timedelta(days=env_int("INFERPLANE_USER_TOKEN_TTL_DAYS", 30, minimum=1)),
    "AUTO_REFRESH": False,
    "AUTH_HEADER_PREFIX": "Token",
}

SPECTACULAR_SETTINGS = {
    "TITLE": "Inferplane control API",
    "DESCRIPTION": "Tenants, members, API keys, limits and audit log. "
    "The OpenAI-compatible data plane lives under /v1.",
    "VERSION": "1",
    "SERVE_INCLUDE_SCHEMA": False,
    # Swagger UI from the vendored sidecar package: no CDN, works offline.
    "SWAGGER_UI_DIST": "SIDECAR",
    "SWAGGER_UI_FAVICON_HREF": "SIDECAR",
    "COMPONENT_SPLIT_REQUEST": True,
}

# --- Static files, i18n ----------------------------------------------------------------------

STATIC_URL = "/static/"
STATIC_ROOT = VAR_DIR / "static"
# Uploaded files (LoRA adapters): a directory under var/ by default.
MEDIA_ROOT = Path(env_str("INFERPLANE_MEDIA_ROOT", str(VAR_DIR / "media")))
ADAPTER_MAX_BYTES = env_int("INFERPLANE_ADAPTER_MAX_BYTES", 256 * 1024 * 1024, minimum=1024)
# Per tenant: versions not deleted (rejected ones too) and the bytes they keep.
ADAPTER_MAX_VERSIONS_PER_TENANT = env_int(
    "INFERPLANE_ADAPTER_MAX_VERSIONS_PER_TENANT", 100, minimum=1
)
ADAPTER_MAX_BYTES_PER_TENANT = env_int(
    "INFERPLANE_ADAPTER_MAX_BYTES_PER_TENANT", 10 * 1024**3, minimum=1024
)
# One validation: soft time limit (the version is rejected as taking too long; the hard
# limit, 30 s later, kills the worker process), and tries on storage or database errors.
ADAPTER_VALIDATION_SECONDS = env_int("INFERPLANE_ADAPTER_VALIDATION_SECONDS", 300, minimum=1)
ADAPTER_VALIDATION_RETRIES = env_int("INFERPLANE_ADAPTER_VALIDATION_RETRIES", 3, minimum=0)
# Still validating after this long (a killed worker, a lost message): rejected by a sweep.
# Keep it above (retries + 1) x (seconds + 30) plus the backoff between tries.
ADAPTER_VALIDATION_DEADLINE_MINUTES = env_int(
    "INFERPLANE_ADAPTER_VALIDATION_DEADLINE_MINUTES", 30, minimum=1
)
# Uploaded files: the filesystem (MEDIA_ROOT) unless INFERPLANE_STORAGE=s3 (any
# S3-compatible store, through django-storages). Engines load adapters from a local path:
# with S3, from copies in ADAPTER_CACHE_DIR, a volume they share with the worker.
STORAGE_KIND = env_choice("INFERPLANE_STORAGE", "filesystem", {"filesystem", "s3"})
ADAPTER_CACHE_DIR = Path(env_str("INFERPLANE_ADAPTER_CACHE_DIR", str(VAR_DIR / "adapter-cache")))
_DEFAULT_STORAGE: dict[str, Any] = {"BACKEND": "django.core.files.storage.FileSystemStorage"}
if STORAGE_KIND == "s3":
    _DEFAULT_STORAGE = {
        "BACKEND": "storages.backends.s3.S3Storage",
        "OPTIONS": {
            "bucket_name": env_str("INFERPLANE_S3_BUCKET"),
            "endpoint_url": env_str("INFERPLANE_S3_ENDPOINT_URL", "") or None,
            "region_name": env_str("INFERPLANE_S3_REGION", "") or None,
            "access_key": env_str("INFERPLANE_S3_ACCESS_KEY_ID", "") or None,
            "secret_key": env_str("INFERPLANE_S3_SECRET_ACCESS_KEY", "") or None,
            "default_acl": None,
            "file_overwrite": False,
        },
    }
STORAGES = {
    "default": _DEFAULT_STORAGE,
    "staticfiles": {
        "BACKEND": "whitenoise.storage.CompressedManifestStaticFilesStorage"
        if PRODUCTION
        else "django.contrib.staticfiles.storage.StaticFilesStorage"
    },
}
# Locally the files are served straight from the apps (no collectstatic step), DEBUG or not.
WHITENOISE_USE_FINDERS = not PRODUCTION
WHITENOISE_AUTOREFRESH = not PRODUCTION

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

# --- Security --------------------------------------------------------------------------------

SESSION_COOKIE_HTTPONLY = True
CSRF_COOKIE_HTTPONLY = False  # HTMX reads it to send X-CSRFToken
X_FRAME_OPTIONS = "DENY"
# Content-Security-Policy on every response (Django's own middleware). Scripts and styles
# come from this origin only; the few inline ones (Swagger UI's set-up, the admin's) carry
# the per-response nonce. 'self' covers ws:/wss: to this host (CSP Level 3), which the
# operator page and the playground use. data: images: Swagger UI's icons.
SECURE_CSP = {
    "default-src": [CSP.SELF],
    "script-src": [CSP.SELF, CSP.NONCE],
    "style-src": [CSP.SELF, CSP.NONCE],
    "img-src": [CSP.SELF, "data:"],
    "connect-src": [CSP.SELF],
    "object-src": [CSP.NONE],
    "base-uri": [CSP.NONE],
    "frame-ancestors": [CSP.NONE],
    "form-action": [CSP.SELF],
}

# Failed password logins (dashboard, control API tokens, admin), counted by django-axes in
# the cache (Redis) per username and per client address: at the limit, logins for that
# username or from that address answer 429 for the cool-off. Behind a proxy, let uvicorn
# take the client address from X-Forwarded-For (FORWARDED_ALLOW_IPS), or every client
# shares the proxy's.
AXES_HANDLER = "axes.handlers.cache.AxesCacheHandler"
AXES_LOCKOUT_PARAMETERS = ["username", "ip_address"]
AXES_FAILURE_LIMIT = env_int("INFERPLANE_LOGIN_FAILURE_LIMIT", 10, minimum=1)
AXES_COOLOFF_TIME = timedelta(
    seconds=env_int("INFERPLANE_LOGIN_COOLOFF_SECONDS", 15 * 60, minimum=1)
)
# A lockout ends on time: attempts during it neither count nor extend it.
AXES_RESET_COOL_OFF_ON_FAILURE_DURING_LOCKOUT = False
AXES_RESET_ON_SUCCESS = False  # else one good account would reset its address's count
AXES_USERNAME_CALLABLE = "controlplane.login_throttle.counted_username"
AXES_LOCKOUT_CALLABLE = "controlplane.login_throttle.lockout_response"
AXES_ENABLE_ADMIN = False  # nothing in the database to show: the counts live in Redis
AXES_VERBOSE = False  # no banner on every manage.py command
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
if PRODUCTION:
    # TLS ends at the ingress; trust its X-Forwarded-Proto.
    SECURE_PROXY_SSL_HEADER = ("HTTP_X_FORWARDED_PROTO", "https")
    SECURE_SSL_REDIRECT = env_bool("SECURE_SSL_REDIRECT", True)
    SECURE_HSTS_SECONDS = env_int("SECURE_HSTS_SECONDS", 31_536_000, minimum=0)
    SECURE_HSTS_INCLUDE_SUBDOMAINS = env_bool("SECURE_HSTS_INCLUDE_SUBDOMAINS", True)
    SECURE_HSTS_PRELOAD = env_bool("SECURE_HSTS_PRELOAD", True)
    SESSION_COOKIE_SECURE = True
    CSRF_COOKIE_SECURE = True

# --- Inferplane --------------------------------------------------------------------------------

# How long a rotated key keeps working, unless the caller says otherwise.
INFERPLANE_KEY_ROTATION_GRACE_SECONDS = env_int(
    "INFERPLANE_KEY_ROTATION_GRACE_SECONDS", 24 * 3600, minimum=0
)
INFERPLANE_PROBE_TIMEOUT_SECONDS = env_int("INFERPLANE_PROBE_TIMEOUT_SECONDS", 3, minimum=1)
# DNS discovery of replicas asks this server (host, host:port, [v6]:port) instead of the
# ones in /etc/resolv.conf.
INFERPLANE_DNS_NAMESERVER = env_str("INFERPLANE_DNS_NAMESERVER", "")
if INFERPLANE_DNS_NAMESERVER and not re.fullmatch(
    r"(\[[0-9A-Fa-f:.]+\]|[0-9A-Za-z.-]+)(:\d{1,5})?", INFERPLANE_DNS_NAMESERVER
):
    raise ImproperlyConfigured(
        f"INFERPLANE_DNS_NAMESERVER={INFERPLANE_DNS_NAMESERVER!r} is not host, host:port "
        "or [v6-address]:port"
    )
INFERPLANE_MAX_BODY_BYTES = env_int("INFERPLANE_MAX_BODY_BYTES", 4 * 1024 * 1024, minimum=1024)
# The gateway and the engines (docs/api.md, "Timeouts and limits"). First byte: from sending a
# request to the engine's first token (a long prefill on a busy GPU takes seconds, never a
# minute); a replica that stays silent longer is treated as failed and the request goes to
# another. Stall: the longest silence mid-stream before the stream is ended as failed
# (decode steps take milliseconds; a preempted sequence can wait a few seconds).
INFERPLANE_ENGINE_CONNECT_TIMEOUT_SECONDS = env_int(
    "INFERPLANE_ENGINE_CONNECT_TIMEOUT_SECONDS", 3, minimum=1
)
INFERPLANE_ENGINE_FIRST_BYTE_TIMEOUT_SECONDS = env_int(
    "INFERPLANE_ENGINE_FIRST_BYTE_TIMEOUT_SECONDS", 60, minimum=1
)
INFERPLANE_ENGINE_STALL_TIMEOUT_SECONDS = env_int(
    "INFERPLANE_ENGINE_STALL_TIMEOUT_SECONDS", 30, minimum=1
)
# A stream's tokens after its first are written at most this often: what the engine sends in
# between goes out in one write (the first token never waits). 0 writes each read at once.
INFERPLANE_STREAM_COALESCE_MS = env_int("INFERPLANE_STREAM_COALESCE_MS", 50, minimum=0)
# ... while the web process relays at least this many streams (1: always): a stream alone
# goes out token by token; a crowd's writes are where the web processes' CPU goes.
INFERPLANE_STREAM_COALESCE_FROM_STREAMS = env_int(
    "INFERPLANE_STREAM_COALESCE_FROM_STREAMS", 8, minimum=1
)
# A batch line's answer comes whole (not streamed): the longest it may take in all. Meanwhile
# the line's replica is watched (the health probe marks a dead or stuck engine down within
# seconds, and the line then moves at once); this bounds only what no probe sees. An answer
# slower than this is a 504 for that request: the replica stays in rotation (slow is not
# dead: the probe decides).
INFERPLANE_ENGINE_WHOLE_TIMEOUT_SECONDS = env_int(
    "INFERPLANE_ENGINE_WHOLE_TIMEOUT_SECONDS", 900, minimum=1
)
# A /v1/ws socket that has not authenticated by then is closed.
INFERPLANE_WS_AUTH_TIMEOUT_SECONDS = env_int("INFERPLANE_WS_AUTH_TIMEOUT_SECONDS", 10, minimum=1)
# Bodies of everything outside /v1 (dashboard, control API, admin): Django would otherwise
# spool any size to a temporary file before a view could refuse it (controlplane.asgi).
INFERPLANE_MAX_CONTROL_BODY_BYTES = env_int(
    "INFERPLANE_MAX_CONTROL_BODY_BYTES", 1024 * 1024, minimum=1024
)
# Hosts whose https image URLs a multimodal model may be sent (and the domains under them);
# empty: images only inline, as data: URLs.
INFERPLANE_MEDIA_URL_DOMAINS = frozenset(
    d.lower().lstrip(".") for d in env_list("INFERPLANE_MEDIA_URL_DOMAINS", [])
)
# The key the engines require (vLLM --api-key / VLLM_API_KEY, from the same secret); empty:
# they require none (the local engines of `make run`).
INFERPLANE_ENGINE_API_KEY = env_str("INFERPLANE_ENGINE_API_KEY", "")
# A non-streamed answer is assembled in memory: past this size it is refused (stream it).
# How long the Responses API keeps a stored response (``store``, the default): OpenAI's 30
# days. ``previous_response_id`` can continue from it until then; GET and DELETE reach it.
INFERPLANE_RESPONSES_RETENTION_DAYS = env_int("INFERPLANE_RESPONSES_RETENTION_DAYS", 30, minimum=1)
# The response cache (docs/cache.md), per tenant: at most this many answers and bytes (the
# least recently used go first), and no answer larger than the last.
INFERPLANE_RESPONSE_CACHE_MAX_ENTRIES = env_int(
    "INFERPLANE_RESPONSE_CACHE_MAX_ENTRIES", 10_000, minimum=1
)
INFERPLANE_RESPONSE_CACHE_MAX_BYTES = env_int(
    "INFERPLANE_RESPONSE_CACHE_MAX_BYTES", 64 * 1024 * 1024, minimum=64 * 1024
)
INFERPLANE_RESPONSE_CACHE_MAX_ENTRY_BYTES = env_int(
    "INFERPLANE_RESPONSE_CACHE_MAX_ENTRY_BYTES", 256 * 1024, minimum=1024
)
# The semantic cache's embedding of a request's text: given up (an exact-only lookup) after
# this long, so a slow or full embedding pool never holds a request up for longer.
INFERPLANE_RESPONSE_CACHE_EMBED_MS = env_int("INFERPLANE_RESPONSE_CACHE_EMBED_MS", 2000, minimum=50)
# The semantic cache's vectors a web process keeps in memory (rows of the partitions it looked
# in last; the least recently used partitions are dropped, and fetched again when needed).
INFERPLANE_RESPONSE_CACHE_MIRROR_ROWS = env_int(
    "INFERPLANE_RESPONSE_CACHE_MIRROR_ROWS", 200_000, minimum=1000
)
if INFERPLANE_RESPONSE_CACHE_MAX_ENTRY_BYTES > INFERPLANE_RESPONSE_CACHE_MAX_BYTES:
    raise ImproperlyConfigured(
        "INFERPLANE_RESPONSE_CACHE_MAX_ENTRY_BYTES must not exceed "
        "INFERPLANE_RESPONSE_CACHE_MAX_BYTES (one answer larger than a tenant's whole cache)."
    )
INFERPLANE_MAX_RESPONSE_BYTES = env_int(
    "INFERPLANE_MAX_RESPONSE_BYTES", 16 * 1024 * 1024, minimum=64 * 1024
)
# A usage-spool entry read by a flusher that has not acknowledged it for this long (it died,
# or waits on a locked table) is taken over by the next flusher (billing.spool).
INFERPLANE_USAGE_CLAIM_IDLE_SECONDS = env_int("INFERPLANE_USAGE_CLAIM_IDLE_SECONDS", 30, minimum=1)
# How long a drain's blocking read waits for work before it looks again (controlplane/drains.py):
# the idle cost of each drain is one read per this many seconds.
INFERPLANE_DRAIN_BLOCK_SECONDS = env_int("INFERPLANE_DRAIN_BLOCK_SECONDS", 10, minimum=1)

# --- Logs and metrics -------------------------------------------------------------------------
# "plain" for a terminal, "json" for a log pipeline: one JSON object per line, each with the
# request id of the request it was logged for (controlplane.logs); scripts/web.sh gives
# uvicorn's own lines the same format.
INFERPLANE_LOG_FORMAT = env_choice("INFERPLANE_LOG_FORMAT", "plain", {"plain", "json"})
LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "filters": {"request_id": {"()": "controlplane.logs.RequestIdFilter"}},
    "formatters": {
        "plain": {"format": "%(asctime)s %(levelname)s %(name)s %(message)s"},
        "json": {
            "()": "controlplane.logs.JsonFormatter",
            "fmt": "%(levelname)s %(name)s %(message)s %(request_id)s",
            "rename_fields": {"levelname": "level", "name": "logger"},
            "timestamp": "time",  # ISO 8601, UTC
        },
    },
    "handlers": {
        "console": {
            "class": "logging.StreamHandler",
            "formatter": INFERPLANE_LOG_FORMAT,
            "filters": ["request_id"],
        }
    },
    "root": {"handlers": ["console"], "level": env_str("LOG_LEVEL", "INFO")},
    "loggers": {
        "django.db.backends": {"level": "INFO"},
        # One line per request to the engines, or per periodic task, drowns what matters.
        "httpx": {"level": "WARNING"},
        "celery.app.trace": {"level": "WARNING"},
        "celery.worker.strategy": {"level": "WARNING"},
        "celery.beat": {"level": "WARNING"},
        # uvicorn's lines in the same format. Only uvicorn.error: configuring its parent
        # "uvicorn" would make dictConfig reset uvicorn.access, which --no-access-log turned
        # off (the gateway writes one line per completion request itself, below).
        "uvicorn.error": {"handlers": ["console"], "propagate": False},
        # The completion log: one line per metered request (LOG_LEVEL_REQUESTS=WARNING: none).
        "inferplane.requests": {"level": env_str("LOG_LEVEL_REQUESTS", "INFO")},
    },
}
# A label per tenant for this many tenants per process (the first seen); the rest are "other".
INFERPLANE_METRICS_TENANTS = env_int("INFERPLANE_METRICS_TENANTS", 100, minimum=0)
# GET /metrics needs "Authorization: Bearer <this>"; unset, it answers no one (the exposition
# names tenants and their spend). `make run` generates one (var/metrics-token); Compose and
# the Kubernetes PodMonitor give it to Prometheus.
INFERPLANE_METRICS_TOKEN = env_str("INFERPLANE_METRICS_TOKEN", "")

# --- Files and batches ------------------------------------------------------------------------
# OpenAI's limits: an input file of at most 200 MB and 50,000 requests.
INFERPLANE_FILE_MAX_BYTES = env_int("INFERPLANE_FILE_MAX_BYTES", 200 * 1024 * 1024, minimum=1024)
INFERPLANE_BATCH_MAX_LINES = env_int("INFERPLANE_BATCH_MAX_LINES", 50_000, minimum=1)
INFERPLANE_BATCH_MAX_LINE_BYTES = env_int(
    "INFERPLANE_BATCH_MAX_LINE_BYTES", 1024 * 1024, minimum=1024
)
# What each tenant may keep and queue, unless the operator sets its own (`manage.py
# tenant_limits`, the control API, the dashboard's limits page); docs/isolation.md.
INFERPLANE_QUOTA_DEFAULTS = {
    "storage_mb": env_int("INFERPLANE_DEFAULT_STORAGE_MB", 10 * 1024, minimum=1),
    "max_open_batches": env_int("INFERPLANE_DEFAULT_OPEN_BATCHES", 50, minimum=1),
    "batch_queue_tokens": env_int("INFERPLANE_DEFAULT_BATCH_QUEUE_TOKENS", 50_000_000, minimum=1),
}
# Files (uploads without an earlier expiry, batch outputs) and finished batches' lines are
# deleted this many days after they were made (OpenAI keeps batch files 30 days).
INFERPLANE_RETENTION_DAYS = env_int("INFERPLANE_RETENTION_DAYS", 30, minimum=1)
# A worker's claim on the lines it runs; lines of a worker that died run again after it.
INFERPLANE_BATCH_LEASE_SECONDS = env_int("INFERPLANE_BATCH_LEASE_SECONDS", 300, minimum=5)
# Lines one worker process keeps in flight (admission shares the spot pool between tenants).
INFERPLANE_BATCH_CONCURRENCY = env_int("INFERPLANE_BATCH_CONCURRENCY", 128, minimum=1)
# The request bodies one worker process keeps in flight, in bytes (as well as at most
# INFERPLANE_BATCH_CONCURRENCY lines): a line's body grows up to ~25x when parsed, so many
# lines near the line bound would otherwise take the worker past its memory. One line is
# always taken, so the bound is this plus one line.
INFERPLANE_BATCH_INFLIGHT_BYTES = env_int(
    "INFERPLANE_BATCH_INFLIGHT_BYTES", 8 * 1024 * 1024, minimum=64 * 1024
)
# How long one task runs lines before it queues its successor (batches take turns).
INFERPLANE_BATCH_RUN_SECONDS = env_int("INFERPLANE_BATCH_RUN_SECONDS", 60, minimum=1)
# How long past its run time a run task may still be finishing its lines in flight: until
# then the sweeper takes it for alive (after, a worker that died holding it is replaced).
INFERPLANE_BATCH_RUN_GRACE_SECONDS = env_int("INFERPLANE_BATCH_RUN_GRACE_SECONDS", 60, minimum=1)
# A line that reached an engine and came back with a passing failure (a 5xx, an answer slower
# than the bound above, a replica that died under it) this many times fails, with an error
# line; the batch goes on. Waiting for capacity (no replica, a full queue) costs no attempt.
INFERPLANE_BATCH_LINE_MAX_ATTEMPTS = env_int("INFERPLANE_BATCH_LINE_MAX_ATTEMPTS", 5, minimum=1)
# A batch line's answer is held whole in the worker, with up to INFERPLANE_BATCH_CONCURRENCY
# others: one larger than this fails its line (response_too_large). The worker's answers in
# memory are at most the two multiplied (256 MiB by default).
INFERPLANE_BATCH_MAX_ANSWER_BYTES = env_int(
    "INFERPLANE_BATCH_MAX_ANSWER_BYTES", 2 * 1024 * 1024, minimum=64 * 1024
)

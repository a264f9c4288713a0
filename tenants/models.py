from __future__ import annotations

from datetime import datetime

from django.conf import settings
from django.contrib.auth.models import AbstractUser
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.utils import timezone

from tenants.priority import DEFAULT_CLASS, PriorityClass, lowest

SLUG_RE = r"^[a-z0-9](?:[a-z0-9-]{0,38}[a-z0-9])?$"
slug_validator = RegexValidator(
    SLUG_RE,
    "Use 1-40 lowercase letters, digits and hyphens, starting and ending with a letter or digit.",
)

# Bounds that keep limits inside what Redis counters and Postgres bigints hold comfortably.
MAX_RATE = 1_000_000_000
MAX_BUDGET = 10**15


class User(AbstractUser):
    """Inferplane's user. Platform operators are ``is_staff``; everything else is per tenant."""


class Role(models.TextChoices):
    OWNER = "owner", "Owner"
    ADMIN = "admin", "Admin"
    DEVELOPER = "developer", "Developer"
    FINANCE = "finance", "Finance"
    VIEWER = "viewer", "Viewer"


def _limit(
    help_text: str, *, big: bool = False, blank: str = "unlimited"
) -> models.Field[int | None, int | None]:
    """A limit or quota field: at least 1, bounded; blank (NULL) means ``blank``."""
    field_class = models.PositiveBigIntegerField if big else models.PositiveIntegerField
    return field_class(
        null=True,
        blank=True,
        validators=[MinValueValidator(1), MaxValueValidator(MAX_BUDGET if big else MAX_RATE)],
        help_text=f"{help_text} Blank means {blank}.",
    )


def tighter(*limits: int | None) -> int | None:
    """The limit that applies where several do (a key's and its tenant's): the smallest one
    set, None when none is. (Limits are at least 1; where they travel as integers, 0 says
    "none", and is read as unset here too.) The one place this is decided."""
    values = [v for v in limits if v]
    return min(values) if values else None


def _quota(help_text: str, *, big: bool = False) -> models.Field[int | None, int | None]:
    return _limit(help_text, big=big, blank="the platform's default")


class LimitFields(models.Model):
    """Quota fields shared by tenants and (as tighter overrides) by their API keys."""

    rpm = _limit("Requests per minute.")
    tpm = _limit("Tokens (prompt + completion) per minute.")
    max_concurrency = _limit("Requests in flight at once.")
    max_tokens_per_request = _limit("Upper bound for max_tokens on one request.")
    monthly_token_budget = _limit("Tokens per calendar month (UTC).", big=True)
    monthly_spend_budget_micros = _limit("Spend per calendar month, in micro-dollars.", big=True)

    LIMIT_NAMES = (
        "rpm",
        "tpm",
        "max_concurrency",
        "max_tokens_per_request",
        "monthly_token_budget",
        "monthly_spend_budget_micros",
    )

    class Meta:
        abstract = True

    def limits(self) -> dict[str, int | None]:
        return {name: getattr(self, name) for name in self.LIMIT_NAMES}


class Tenant(LimitFields):
    class Status(models.TextChoices):
        ACTIVE = "active", "Active"
        SUSPENDED = "suspended", "Suspended"

    slug = models.CharField(max_length=40, unique=True, validators=[slug_validator])
    name = models.CharField(max_length=200)
    status = models.CharField(max_length=16, choices=Status.choices, default=Status.ACTIVE)
    weight = models.PositiveSmallIntegerField(
        default=1,
        validators=[MinValueValidator(1), MaxValueValidator(1000)],
        help_text="Fair-share weight: a tenant of weight 2 gets twice the tokens of weight 1 "
        "when both are backlogged.",
    )
    priority_class = models.CharField(
        max_length=16,
        choices=PriorityClass.choices,
        default=DEFAULT_CLASS,
        help_text="The highest priority class its requests may run in (docs/priority.md).",
    )
    # Quotas on what a tenant keeps and queues (files, batches); blank: the platform's
    # default (settings.INFERPLANE_QUOTA_DEFAULTS, which the operator sets). docs/isolation.md.
    storage_mb = _quota("Stored files (uploads, batch outputs), in MiB.")
    max_open_batches = _quota("Batches not yet finished at once.")
    batch_queue_tokens = _quota(
        "Tokens of batches waiting or running at once (estimated when a batch is validated).",
        big=True,
    )

    # The response cache (docs/cache.md): off unless the tenant turns it on; its entries are
    # the tenant's own, kept this long.
    class Cache(models.TextChoices):
        OFF = "off", "Off"
        EXACT = "exact", "Exact: a repeated request gets the stored answer"
        SEMANTIC = "semantic", "Semantic: exact, and single-turn requests close in meaning"

    response_cache = models.CharField(max_length=8, choices=Cache.choices, default=Cache.OFF)
    response_cache_ttl_seconds = models.PositiveIntegerField(
        default=3600,
        validators=[MinValueValidator(60), MaxValueValidator(30 * 86400)],
        help_text="How long a cached answer is served (60 s to 30 days).",
    )
    response_cache_threshold = models.FloatField(
        default=0.95,
        validators=[MinValueValidator(0.5), MaxValueValidator(1.0)],
        help_text="Semantic: the cosine similarity a stored request's text needs (0.5 to 1).",
    )
    response_cache_embedding_model = models.CharField(
        max_length=200,
        blank=True,
        help_text="Semantic: the embedding model (on the platform's own pool) that embeds "
        "the request's text; one the tenant may call.",
    )
    created_at = models.DateTimeField(default=timezone.now)
    updated_at = models.DateTimeField(auto_now=True)

    QUOTA_NAMES = ("storage_mb", "max_open_batches", "batch_queue_tokens")

    class Meta:
        ordering = ["slug"]

    def __str__(self) -> str:
        return self.slug

    @property
    def is_active(self) -> bool:
        return self.status == self.Status.ACTIVE

    def quota(self, name: str) -> int:
        """A quota as it applies: the tenant's own, else the platform's default."""
        own: int | None = getattr(self, name)
        return own if own is not None else int(settings.INFERPLANE_QUOTA_DEFAULTS[name])

    def quotas(self) -> dict[str, int]:
        return {name: self.quota(name) for name in self.QUOTA_NAMES}


class Membership(models.Model):
    user = models.ForeignKey(
        settings.AUTH_USER_MODEL, on_delete=models.CASCADE, related_name="memberships"
    )
    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="memberships")
    role = models.CharField(max_length=16, choices=Role.choices)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["user", "tenant"], name="membership_unique_user")
        ]
        ordering = ["tenant", "user__username"]

    def __str__(self) -> str:
        return f"{self.user} @ {self.tenant} ({self.role})"


class Invitation(models.Model):
    """A one-time link that makes whoever opens it (logged in, or signing up) a member with
    ``role``. Only the SHA-256 of its token is stored; there is no mail server: the inviter
    passes the link on."""

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="invitations")
    role = models.CharField(max_length=16, choices=Role.choices)
    token_hash = models.CharField(max_length=64, unique=True, editable=False)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField()
    accepted_at = models.DateTimeField(null=True, blank=True)
    accepted_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    revoked_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"invitation to {self.tenant} as {self.role}"

    @property
    def is_open(self) -> bool:
        return (
            self.accepted_at is None
            and self.revoked_at is None
            and self.expires_at > timezone.now()
        )


class ApiKey(LimitFields):
    """A tenant's API key. Only the prefix and the SHA-256 of the whole key are stored.

    The limit fields are overrides: the effective limit is the tighter of key and tenant.
    """

    class Scope(models.TextChoices):
        INFERENCE = "inference", "Inference (models, completions, moderations)"
        BATCH = "batch", "Batch (files and batches)"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="api_keys")
    name = models.CharField(max_length=100)
    prefix = models.CharField(max_length=16, unique=True, editable=False)
    secret_hash = models.CharField(max_length=64, unique=True, editable=False)
    scopes = models.JSONField(default=list)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL,
        null=True,
        blank=True,
        on_delete=models.SET_NULL,
        related_name="+",
    )
    created_at = models.DateTimeField(default=timezone.now)
    expires_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    # A key can keep its requests out of its tenant's response cache (docs/cache.md).
    use_response_cache = models.BooleanField(default=True)
    # Blank: the tenant's class; set: a lower one for this key's requests (docs/priority.md).
    priority_class = models.CharField(
        max_length=16, choices=PriorityClass.choices, blank=True, default=""
    )
    rotated_from = models.OneToOneField(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="rotated_to"
    )

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["tenant", "-created_at"], name="apikey_tenant_created")]

    def __str__(self) -> str:
        return f"{self.display_prefix} ({self.name})"

    @property
    def effective_priority_class(self) -> str:
        """The class its requests run in: its own, never above its tenant's."""
        if not self.priority_class:
            return self.tenant.priority_class
        return lowest(self.tenant.priority_class, self.priority_class)

    @property
    def display_prefix(self) -> str:
        from tenants.keys import KEY_TAG

        return f"{KEY_TAG}{self.prefix}…"

    def is_active_at(self, when: datetime | None = None) -> bool:
        now = when or timezone.now()
        if self.revoked_at is not None:
            return False
        return self.expires_at is None or self.expires_at > now

    @property
    def is_active(self) -> bool:
        return self.is_active_at()

    @property
    def status(self) -> str:
        if self.revoked_at is not None:
            return "revoked"
        if self.expires_at is not None and self.expires_at <= timezone.now():
            return "expired"
        return "active"


class AuditEvent(models.Model):
    """Who changed what, when. Written by every service that changes access or limits."""

    tenant = models.ForeignKey(
        Tenant, null=True, blank=True, on_delete=models.CASCADE, related_name="audit_events"
    )
    actor = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # Kept as text too: the log must still say who acted after a user is deleted, and
    # commands act as "system".
    actor_label = models.CharField(max_length=150)
    action = models.CharField(max_length=64)
    target_type = models.CharField(max_length=32)
    target_id = models.CharField(max_length=64, blank=True)
    target_label = models.CharField(max_length=200, blank=True)
    details = models.JSONField(default=dict, blank=True)
    created_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["-created_at", "-id"]
        indexes = [models.Index(fields=["tenant", "-created_at"], name="audit_tenant_created")]

    def __str__(self) -> str:
        return (
            f"{self.created_at:%Y-%m-%d %H:%M} {self.actor_label} {self.action} {self.target_label}"
        )

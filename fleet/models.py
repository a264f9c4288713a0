from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

from django.core.exceptions import ValidationError
from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.utils import timezone

name_validator = RegexValidator(
    r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,99}$",
    "Use letters, digits, '.', '_', ':' and '-' (no '/': that separates tenant adapters).",
)
replica_name_validator = RegexValidator(
    r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$", "Use letters, digits, '.', '_' and '-'."
)
dns_name_validator = RegexValidator(
    r"^(?=.{1,253}\.?$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)*"
    r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.?$",
    "A DNS name such as vllm-online.inferplane.svc.cluster.local",
)


_HOST = re.compile(
    r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*\.?)$"
)


def engine_url_validator(value: str) -> None:
    """An engine's base URL: http(s), a host (a single-label name such as ``vllm-online``
    is fine: Compose and Kubernetes use them), an optional port and path; nothing else."""
    message = f"{value!r} is not an engine URL like http://10.0.0.5:8000"
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        raise ValidationError(message, code="invalid") from None
    if (
        parts.scheme not in {"http", "https"}
        or not parts.netloc
        or not _HOST.match(parts.netloc.rsplit(":", 1)[0] if port else parts.netloc)
        or parts.username is not None
        or parts.query
        or parts.fragment
        or any(c.isspace() for c in value)
    ):
        raise ValidationError(message, code="invalid")
    if parts.netloc.startswith("["):
        try:
            ipaddress.IPv6Address(parts.hostname or "")
        except ValueError:
            raise ValidationError(message, code="invalid") from None


class Model(models.Model):
    """A model as tenants see it (``name``) and as the engines serve it (``served_name``)."""

    name = models.CharField(max_length=100, unique=True, validators=[name_validator])
    served_name = models.CharField(max_length=200)
    context_length = models.PositiveIntegerField(
        validators=[MinValueValidator(16), MaxValueValidator(10_000_000)]
    )
    supports_lora = models.BooleanField(default=False)

    class Task(models.TextChoices):
        GENERATE = "generate", "Generates text (chat, completions)"
        CLASSIFY = "classify", "Classifies text (a guard model for moderation)"
        EMBED = "embed", "Embeds text (/v1/embeddings)"

    # A classifier is served on vLLM's /classify, reached only through moderation (a guard
    # model in a tenant's policy, or /v1/moderations); an embedding model only through
    # /v1/embeddings (an engine of its own: `--runner pooling --convert embed`). Each /v1
    # endpoint refuses a model of another task.
    task = models.CharField(max_length=16, choices=Task.choices, default=Task.GENERATE)
    # What a chat message may carry besides text. A text-only model refuses other content
    # parts with 400 (they would otherwise reach the engine, and a multimodal engine fetches
    # image URLs from inside the GPU network).
    accepts_images = models.BooleanField(
        default=False, help_text="Chat messages may carry image_url parts (a vision model)."
    )
    accepts_audio = models.BooleanField(
        default=False, help_text="Chat messages may carry input_audio parts (an audio model)."
    )
    architecture = models.JSONField(
        default=dict,
        blank=True,
        help_text="The base model's config.json (hidden_size, num_hidden_layers, ...): what "
        "LoRA adapters for it are checked against.",
    )
    is_public = models.BooleanField(
        default=True, help_text="Visible to every tenant; otherwise only to allowed_tenants."
    )
    allowed_tenants = models.ManyToManyField("tenants.Tenant", blank=True, related_name="+")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "inference_model"  # made by the inference app, before the fleet had its own
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class ModelRoute(models.Model):
    """A name tenants send as ``model`` that splits its requests between targets by integer
    weight: a canary (90 to the stable model, 10 to the new one), rolled back or promoted by
    moving the weights. ``name`` is a model's public name (its own model may be one of the
    targets) or a tenant's adapter address ``<slug>/<name>`` (the targets then are versions
    of that adapter). Each request keeps the target it was given for its whole life."""

    name = models.CharField(max_length=200, unique=True)
    # [[target, weight], ...]: a model's name, or "<slug>/<name>:<version>"; weights >= 0.
    targets = models.JSONField()
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        db_table = "inference_modelroute"  # made by the inference app, before the fleet had its own
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Pool(models.Model):
    class Kind(models.TextChoices):
        DEDICATED = "dedicated", "Dedicated (online)"
        SPOT = "spot", "Spot (batch)"

    class Policy(models.TextChoices):
        VTC = "vtc", "Virtual token counter (token-fair)"
        FCFS = "fcfs", "First come, first served"

    class Discovery(models.TextChoices):
        STATIC = "static", "Static (replicas registered by hand)"
        DNS = "dns", "DNS (every address of a headless Service is a replica)"

    class Scheme(models.TextChoices):
        HTTP = "http", "http"
        HTTPS = "https", "https"

    name = models.CharField(
        max_length=64,
        unique=True,
        validators=[RegexValidator(r"^[a-z0-9][a-z0-9-]{0,63}$", "Lowercase, digits, '-'.")],
    )
    kind = models.CharField(max_length=16, choices=Kind.choices)
    model = models.ForeignKey(Model, on_delete=models.PROTECT, related_name="pools")
    max_inflight = models.PositiveIntegerField(
        default=8,
        validators=[MinValueValidator(1), MaxValueValidator(4096)],
        help_text="Sequences admitted at once per ready replica (a request runs prompts x n "
        "of them); keep it at or below the engine's max_num_seqs so the engine's own queue "
        "stays empty.",
    )
    policy = models.CharField(max_length=8, choices=Policy.choices, default=Policy.VTC)
    max_queue_wait_seconds = models.PositiveIntegerField(
        default=30,
        validators=[MinValueValidator(1), MaxValueValidator(3600)],
        help_text="How long a request may wait for admission before it gets 503.",
    )
    max_lora_rank = models.PositiveSmallIntegerField(
        default=8,
        validators=[MinValueValidator(1), MaxValueValidator(512)],
        help_text="The engines' --max-lora-rank: adapters of a higher rank are refused.",
    )
    max_loras = models.PositiveSmallIntegerField(
        default=4,
        validators=[MinValueValidator(1), MaxValueValidator(256)],
        help_text="The engines' --max-loras: adapters one replica holds at once; loading "
        "another evicts the least recently used.",
    )
    lend_percent = models.PositiveSmallIntegerField(
        default=0,
        validators=[MaxValueValidator(100)],
        help_text="Online pools: the percent of the pool's capacity (sequences) that batch "
        "lines may borrow while no online request waits, in the lowest band; 0 lends none. "
        "An online request that needs the room takes it back at once (the lent line is "
        "aborted and runs again later). Its engines must run with --scheduling-policy "
        "priority (docs/priority.md).",
    )
    discovery = models.CharField(
        max_length=8,
        choices=Discovery.choices,
        default=Discovery.STATIC,
        help_text="Where the replicas come from. DNS: the name is resolved (A and AAAA) at "
        "every probe round; a new address becomes a replica, one that vanished is drained "
        "and then removed.",
    )
    dns_name = models.CharField(
        max_length=253,
        blank=True,
        validators=[dns_name_validator],
        help_text="DNS discovery: the full name of the engines' headless Service, e.g. "
        "vllm-online.inferplane.svc.cluster.local",
    )
    dns_port = models.PositiveIntegerField(
        default=8000,
        validators=[MinValueValidator(1), MaxValueValidator(65535)],
        help_text="DNS discovery: the engines' port.",
    )
    dns_scheme = models.CharField(max_length=5, choices=Scheme.choices, default=Scheme.HTTP)
    drain_grace_seconds = models.PositiveIntegerField(
        default=300,
        validators=[MinValueValidator(1), MaxValueValidator(86400)],
        help_text="DNS discovery: a replica whose address vanished is removed once nothing "
        "runs on it, or after this long regardless.",
    )
    discovery_error = models.CharField(
        max_length=500,
        blank=True,
        editable=False,
        help_text="Why the last DNS resolution failed (the replicas were kept as they were).",
    )
    replica_seq = models.PositiveIntegerField(
        default=0, editable=False, help_text="The number in the last assigned replica name."
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "inference_pool"  # made by the inference app, before the fleet had its own
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name

    def clean(self) -> None:
        if self.discovery == self.Discovery.DNS and not self.dns_name:
            raise ValidationError({"dns_name": "DNS discovery needs the Service's DNS name."})
        if self.lend_percent and self.kind != self.Kind.DEDICATED:
            raise ValidationError(
                {"lend_percent": "Only an online (dedicated) pool lends room to batch lines."}
            )

    @property
    def discovery_url(self) -> str:
        """``static``, or the scheme, name and port every discovered address is served at."""
        if self.discovery != self.Discovery.DNS:
            return self.Discovery.STATIC
        return f"{self.dns_scheme}://{self.dns_name}:{self.dns_port}"


class Replica(models.Model):
    class State(models.TextChoices):
        READY = "ready", "Ready"
        DRAINING = "draining", "Draining"
        DOWN = "down", "Down"

    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="replicas")
    name = models.CharField(
        max_length=64,
        blank=True,
        validators=[replica_name_validator],
        help_text="Short name, unique in the pool, that may be shown outside (the URL is "
        "internal). Left empty: <pool>-<n>.",
    )
    url = models.CharField(
        max_length=200,
        validators=[engine_url_validator],
        help_text="Base URL of the vLLM OpenAI server, e.g. http://10.0.0.5:8000",
    )
    state = models.CharField(max_length=16, choices=State.choices, default=State.DOWN)
    discovered = models.BooleanField(
        default=False,
        editable=False,
        help_text="Added by DNS discovery (which also removes it); otherwise registered by hand.",
    )
    vanished_at = models.DateTimeField(
        null=True,
        blank=True,
        editable=False,
        help_text="When its address left the pool's DNS name: draining until removed.",
    )
    last_probe_at = models.DateTimeField(null=True, blank=True)
    last_error = models.CharField(max_length=500, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "inference_replica"  # made by the inference app, before the fleet had its own
        ordering = ["pool", "url"]
        constraints = [
            models.UniqueConstraint(fields=["pool", "url"], name="replica_unique_url_per_pool"),
            # Blank only for a moment: the admin's forms, until the name is assigned.
            models.UniqueConstraint(
                fields=["pool", "name"],
                condition=~models.Q(name=""),
                name="replica_unique_name_per_pool",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.pool.name}:{self.url}"

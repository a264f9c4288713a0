from __future__ import annotations

from django.core.validators import MaxValueValidator, MinValueValidator, RegexValidator
from django.db import models
from django.utils import timezone

name_validator = RegexValidator(
    r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,99}$",
    "Use letters, digits, '.', '_', ':' and '-' (no '/': that separates tenant adapters).",
)


class Model(models.Model):
    """A model as tenants see it (``name``) and as the engines serve it (``served_name``)."""

    name = models.CharField(max_length=100, unique=True, validators=[name_validator])
    served_name = models.CharField(max_length=200)
    context_length = models.PositiveIntegerField(
        validators=[MinValueValidator(16), MaxValueValidator(10_000_000)]
    )
    supports_lora = models.BooleanField(default=False)
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
        help_text="Requests admitted at once per ready replica; keep it at or below the "
        "engine's max_num_seqs so the engine's own queue stays empty.",
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
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["name"]

    def __str__(self) -> str:
        return self.name


class Replica(models.Model):
    class State(models.TextChoices):
        READY = "ready", "Ready"
        DRAINING = "draining", "Draining"
        DOWN = "down", "Down"

    pool = models.ForeignKey(Pool, on_delete=models.CASCADE, related_name="replicas")
    url = models.URLField(help_text="Base URL of the vLLM OpenAI server, e.g. http://10.0.0.5:8000")
    state = models.CharField(max_length=16, choices=State.choices, default=State.DOWN)
    last_probe_at = models.DateTimeField(null=True, blank=True)
    last_error = models.CharField(max_length=500, blank=True)
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["pool", "url"]
        constraints = [
            models.UniqueConstraint(fields=["pool", "url"], name="replica_unique_url_per_pool")
        ]

    def __str__(self) -> str:
        return f"{self.pool.name}:{self.url}"

"""A tenant's LoRA adapters, one row a version (the table ``tenants_adapter``: the tenants app
made it, before adapters had their models here)."""

from __future__ import annotations

from django.conf import settings
from django.core.validators import RegexValidator
from django.db import models
from django.utils import timezone

from tenants.models import Tenant

adapter_name_validator = RegexValidator(
    r"^[a-z0-9][a-z0-9._-]{0,62}$",
    "Use 1-63 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit.",
)


class Adapter(models.Model):
    """A tenant's LoRA adapter, one version of it. Served as ``<tenant-slug>/<name>`` (the
    newest ready version) or ``<tenant-slug>/<name>:<version>`` to that tenant only.

    The files live content-addressed (``adapters/<sha256>/``) once validated; until then the
    upload waits in a staging area that validation always empties.
    """

    class Status(models.TextChoices):
        VALIDATING = "validating", "Validating"
        READY = "ready", "Ready"
        REJECTED = "rejected", "Rejected"

    tenant = models.ForeignKey(Tenant, on_delete=models.CASCADE, related_name="adapters")
    name = models.CharField(max_length=63, validators=[adapter_name_validator])
    version = models.PositiveIntegerField()
    status = models.CharField(max_length=12, choices=Status.choices, default=Status.VALIDATING)
    reason = models.CharField(max_length=500, blank=True, help_text="Why it was rejected.")
    staging_path = models.CharField(max_length=300, blank=True)
    sha256 = models.CharField(max_length=64, blank=True, db_index=True)
    size_bytes = models.PositiveBigIntegerField(default=0)
    base_model = models.ForeignKey(
        "fleet.Model", null=True, blank=True, on_delete=models.PROTECT, related_name="+"
    )
    rank = models.PositiveIntegerField(null=True, blank=True)
    alpha = models.FloatField(null=True, blank=True)
    target_modules = models.JSONField(default=list, blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)
    validated_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    deleted_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "tenants_adapter"  # made by the tenants app, before adapters had models
        ordering = ["name", "-version"]
        constraints = [
            models.UniqueConstraint(
                fields=["tenant", "name", "version"], name="adapter_unique_version"
            )
        ]

    def __str__(self) -> str:
        return f"{self.name}:{self.version}"

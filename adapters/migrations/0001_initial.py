"""The Adapter table, moved here from the tenants app: the table (tenants_adapter) stays, only
Django's state and the content type change."""

import django.core.validators
import django.db.models.deletion
import django.utils.timezone
from django.conf import settings
from django.db import migrations, models

MODELS = ["adapter"]


def _content_types_to(label: str):
    """Permissions and admin history follow the models: their content types change app."""
    other = "tenants" if label == "adapters" else "adapters"

    def move(apps, schema_editor):
        content_type = apps.get_model("contenttypes", "ContentType")
        # Rows under the label already are ones Django made meanwhile (a partial rollback
        # put the models back in the other app's state): the moved rows, with their
        # permissions and history, replace them.
        if content_type.objects.filter(app_label=other, model__in=MODELS).exists():
            content_type.objects.filter(app_label=label, model__in=MODELS).delete()
        content_type.objects.filter(app_label=other, model__in=MODELS).update(app_label=label)

    return move


class Migration(migrations.Migration):
    initial = True

    dependencies = [
        ("contenttypes", "0002_remove_content_type_name"),
        ("fleet", "0001_initial"),
        ("tenants", "0005_adapter_to_adapters_app"),
        migrations.swappable_dependency(settings.AUTH_USER_MODEL),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="Adapter",
                    fields=[
                        (
                            "id",
                            models.BigAutoField(
                                auto_created=True,
                                primary_key=True,
                                serialize=False,
                                verbose_name="ID",
                            ),
                        ),
                        (
                            "name",
                            models.CharField(
                                max_length=63,
                                validators=[
                                    django.core.validators.RegexValidator(
                                        "^[a-z0-9][a-z0-9._-]{0,62}$",
                                        "Use 1-63 lowercase letters, digits, '.', '_' or '-', starting with a letter or digit.",
                                    )
                                ],
                            ),
                        ),
                        ("version", models.PositiveIntegerField()),
                        (
                            "status",
                            models.CharField(
                                choices=[
                                    ("validating", "Validating"),
                                    ("ready", "Ready"),
                                    ("rejected", "Rejected"),
                                ],
                                default="validating",
                                max_length=12,
                            ),
                        ),
                        (
                            "reason",
                            models.CharField(
                                blank=True, help_text="Why it was rejected.", max_length=500
                            ),
                        ),
                        ("staging_path", models.CharField(blank=True, max_length=300)),
                        ("sha256", models.CharField(blank=True, db_index=True, max_length=64)),
                        ("size_bytes", models.PositiveBigIntegerField(default=0)),
                        ("rank", models.PositiveIntegerField(blank=True, null=True)),
                        ("alpha", models.FloatField(blank=True, null=True)),
                        ("target_modules", models.JSONField(blank=True, default=list)),
                        ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                        ("validated_at", models.DateTimeField(blank=True, null=True)),
                        ("last_used_at", models.DateTimeField(blank=True, null=True)),
                        ("deleted_at", models.DateTimeField(blank=True, null=True)),
                        (
                            "base_model",
                            models.ForeignKey(
                                blank=True,
                                null=True,
                                on_delete=django.db.models.deletion.PROTECT,
                                related_name="+",
                                to="fleet.model",
                            ),
                        ),
                        (
                            "created_by",
                            models.ForeignKey(
                                blank=True,
                                null=True,
                                on_delete=django.db.models.deletion.SET_NULL,
                                related_name="+",
                                to=settings.AUTH_USER_MODEL,
                            ),
                        ),
                        (
                            "tenant",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.CASCADE,
                                related_name="adapters",
                                to="tenants.tenant",
                            ),
                        ),
                    ],
                    options={
                        "db_table": "tenants_adapter",
                        "ordering": ["name", "-version"],
                        "constraints": [
                            models.UniqueConstraint(
                                fields=("tenant", "name", "version"), name="adapter_unique_version"
                            )
                        ],
                    },
                ),
            ],
            database_operations=[],
        ),
        migrations.RunPython(_content_types_to("adapters"), _content_types_to("tenants")),
    ]

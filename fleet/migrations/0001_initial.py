"""The fleet's tables, moved here from the inference app: the tables (inference_*) stay, only
Django's state and the content types change."""

import django.core.validators
import django.db.models.deletion
import django.utils.timezone
from django.db import migrations, models

import fleet.models

MODELS = ["model", "modelroute", "pool", "replica"]


def _content_types_to(label: str):
    """Permissions and admin history follow the models: their content types change app."""
    other = "inference" if label == "fleet" else "fleet"

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
        ("inference", "0009_model_routes"),
        ("tenants", "0005_adapter_to_adapters_app"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.CreateModel(
                    name="ModelRoute",
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
                        ("name", models.CharField(max_length=200, unique=True)),
                        ("targets", models.JSONField()),
                        ("updated_at", models.DateTimeField(auto_now=True)),
                    ],
                    options={
                        "db_table": "inference_modelroute",
                        "ordering": ["name"],
                    },
                ),
                migrations.CreateModel(
                    name="Model",
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
                                max_length=100,
                                unique=True,
                                validators=[
                                    django.core.validators.RegexValidator(
                                        "^[A-Za-z0-9][A-Za-z0-9._:-]{0,99}$",
                                        "Use letters, digits, '.', '_', ':' and '-' (no '/': that separates tenant adapters).",
                                    )
                                ],
                            ),
                        ),
                        ("served_name", models.CharField(max_length=200)),
                        (
                            "context_length",
                            models.PositiveIntegerField(
                                validators=[
                                    django.core.validators.MinValueValidator(16),
                                    django.core.validators.MaxValueValidator(10000000),
                                ]
                            ),
                        ),
                        ("supports_lora", models.BooleanField(default=False)),
                        (
                            "task",
                            models.CharField(
                                choices=[
                                    ("generate", "Generates text (chat, completions)"),
                                    ("classify", "Classifies text (a guard model for moderation)"),
                                ],
                                default="generate",
                                max_length=16,
                            ),
                        ),
                        (
                            "accepts_images",
                            models.BooleanField(
                                default=False,
                                help_text="Chat messages may carry image_url parts (a vision model).",
                            ),
                        ),
                        (
                            "accepts_audio",
                            models.BooleanField(
                                default=False,
                                help_text="Chat messages may carry input_audio parts (an audio model).",
                            ),
                        ),
                        (
                            "architecture",
                            models.JSONField(
                                blank=True,
                                default=dict,
                                help_text="The base model's config.json (hidden_size, num_hidden_layers, ...): what LoRA adapters for it are checked against.",
                            ),
                        ),
                        (
                            "is_public",
                            models.BooleanField(
                                default=True,
                                help_text="Visible to every tenant; otherwise only to allowed_tenants.",
                            ),
                        ),
                        ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                        (
                            "allowed_tenants",
                            models.ManyToManyField(
                                blank=True, related_name="+", to="tenants.tenant"
                            ),
                        ),
                    ],
                    options={
                        "db_table": "inference_model",
                        "ordering": ["name"],
                    },
                ),
                migrations.CreateModel(
                    name="Pool",
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
                                max_length=64,
                                unique=True,
                                validators=[
                                    django.core.validators.RegexValidator(
                                        "^[a-z0-9][a-z0-9-]{0,63}$", "Lowercase, digits, '-'."
                                    )
                                ],
                            ),
                        ),
                        (
                            "kind",
                            models.CharField(
                                choices=[
                                    ("dedicated", "Dedicated (online)"),
                                    ("spot", "Spot (batch)"),
                                ],
                                max_length=16,
                            ),
                        ),
                        (
                            "max_inflight",
                            models.PositiveIntegerField(
                                default=8,
                                help_text="Sequences admitted at once per ready replica (a request runs prompts x n of them); keep it at or below the engine's max_num_seqs so the engine's own queue stays empty.",
                                validators=[
                                    django.core.validators.MinValueValidator(1),
                                    django.core.validators.MaxValueValidator(4096),
                                ],
                            ),
                        ),
                        (
                            "policy",
                            models.CharField(
                                choices=[
                                    ("vtc", "Virtual token counter (token-fair)"),
                                    ("fcfs", "First come, first served"),
                                ],
                                default="vtc",
                                max_length=8,
                            ),
                        ),
                        (
                            "max_queue_wait_seconds",
                            models.PositiveIntegerField(
                                default=30,
                                help_text="How long a request may wait for admission before it gets 503.",
                                validators=[
                                    django.core.validators.MinValueValidator(1),
                                    django.core.validators.MaxValueValidator(3600),
                                ],
                            ),
                        ),
                        (
                            "max_lora_rank",
                            models.PositiveSmallIntegerField(
                                default=8,
                                help_text="The engines' --max-lora-rank: adapters of a higher rank are refused.",
                                validators=[
                                    django.core.validators.MinValueValidator(1),
                                    django.core.validators.MaxValueValidator(512),
                                ],
                            ),
                        ),
                        (
                            "max_loras",
                            models.PositiveSmallIntegerField(
                                default=4,
                                help_text="The engines' --max-loras: adapters one replica holds at once; loading another evicts the least recently used.",
                                validators=[
                                    django.core.validators.MinValueValidator(1),
                                    django.core.validators.MaxValueValidator(256),
                                ],
                            ),
                        ),
                        (
                            "discovery",
                            models.CharField(
                                choices=[
                                    ("static", "Static (replicas registered by hand)"),
                                    (
                                        "dns",
                                        "DNS (every address of a headless Service is a replica)",
                                    ),
                                ],
                                default="static",
                                help_text="Where the replicas come from. DNS: the name is resolved (A and AAAA) at every probe round; a new address becomes a replica, one that vanished is drained and then removed.",
                                max_length=8,
                            ),
                        ),
                        (
                            "dns_name",
                            models.CharField(
                                blank=True,
                                help_text="DNS discovery: the full name of the engines' headless Service, e.g. vllm-online.inferplane.svc.cluster.local",
                                max_length=253,
                                validators=[
                                    django.core.validators.RegexValidator(
                                        "^(?=.{1,253}\\.?$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\\.)*[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?\\.?$",
                                        "A DNS name such as vllm-online.inferplane.svc.cluster.local",
                                    )
                                ],
                            ),
                        ),
                        (
                            "dns_port",
                            models.PositiveIntegerField(
                                default=8000,
                                help_text="DNS discovery: the engines' port.",
                                validators=[
                                    django.core.validators.MinValueValidator(1),
                                    django.core.validators.MaxValueValidator(65535),
                                ],
                            ),
                        ),
                        (
                            "dns_scheme",
                            models.CharField(
                                choices=[("http", "http"), ("https", "https")],
                                default="http",
                                max_length=5,
                            ),
                        ),
                        (
                            "drain_grace_seconds",
                            models.PositiveIntegerField(
                                default=300,
                                help_text="DNS discovery: a replica whose address vanished is removed once nothing runs on it, or after this long regardless.",
                                validators=[
                                    django.core.validators.MinValueValidator(1),
                                    django.core.validators.MaxValueValidator(86400),
                                ],
                            ),
                        ),
                        (
                            "discovery_error",
                            models.CharField(
                                blank=True,
                                editable=False,
                                help_text="Why the last DNS resolution failed (the replicas were kept as they were).",
                                max_length=500,
                            ),
                        ),
                        (
                            "replica_seq",
                            models.PositiveIntegerField(
                                default=0,
                                editable=False,
                                help_text="The number in the last assigned replica name.",
                            ),
                        ),
                        ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                        (
                            "model",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.PROTECT,
                                related_name="pools",
                                to="fleet.model",
                            ),
                        ),
                    ],
                    options={
                        "db_table": "inference_pool",
                        "ordering": ["name"],
                    },
                ),
                migrations.CreateModel(
                    name="Replica",
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
                                blank=True,
                                help_text="Short name, unique in the pool, that may be shown outside (the URL is internal). Left empty: <pool>-<n>.",
                                max_length=64,
                                validators=[
                                    django.core.validators.RegexValidator(
                                        "^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$",
                                        "Use letters, digits, '.', '_' and '-'.",
                                    )
                                ],
                            ),
                        ),
                        (
                            "url",
                            models.CharField(
                                help_text="Base URL of the vLLM OpenAI server, e.g. http://10.0.0.5:8000",
                                max_length=200,
                                validators=[fleet.models.engine_url_validator],
                            ),
                        ),
                        (
                            "state",
                            models.CharField(
                                choices=[
                                    ("ready", "Ready"),
                                    ("draining", "Draining"),
                                    ("down", "Down"),
                                ],
                                default="down",
                                max_length=16,
                            ),
                        ),
                        (
                            "discovered",
                            models.BooleanField(
                                default=False,
                                editable=False,
                                help_text="Added by DNS discovery (which also removes it); otherwise registered by hand.",
                            ),
                        ),
                        (
                            "vanished_at",
                            models.DateTimeField(
                                blank=True,
                                editable=False,
                                help_text="When its address left the pool's DNS name: draining until removed.",
                                null=True,
                            ),
                        ),
                        ("last_probe_at", models.DateTimeField(blank=True, null=True)),
                        ("last_error", models.CharField(blank=True, max_length=500)),
                        ("created_at", models.DateTimeField(default=django.utils.timezone.now)),
                        (
                            "pool",
                            models.ForeignKey(
                                on_delete=django.db.models.deletion.CASCADE,
                                related_name="replicas",
                                to="fleet.pool",
                            ),
                        ),
                    ],
                    options={
                        "db_table": "inference_replica",
                        "ordering": ["pool", "url"],
                        "constraints": [
                            models.UniqueConstraint(
                                fields=("pool", "url"), name="replica_unique_url_per_pool"
                            ),
                            models.UniqueConstraint(
                                condition=models.Q(("name", ""), _negated=True),
                                fields=("pool", "name"),
                                name="replica_unique_name_per_pool",
                            ),
                        ],
                    },
                ),
            ],
            database_operations=[],
        ),
        migrations.RunPython(_content_types_to("fleet"), _content_types_to("inference")),
    ]

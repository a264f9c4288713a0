# The rollups gain the priority class. The days whose records were not all standard are
# recomputed from the ledger here (the rest are standard already: the column's default).

from datetime import UTC, datetime, time, timedelta
from typing import Any

from django.db import migrations, models
from django.db.models import Count, Q, Sum
from django.db.models.functions import Coalesce, TruncDate

BY = ("api_key_id", "model", "adapter", "mode", "priority")


def split_by_class(apps: Any, schema_editor: Any) -> None:
    records = apps.get_model("billing", "UsageRecord").objects
    rollups = apps.get_model("billing", "DailyUsage")
    days = (
        records.exclude(priority="standard")
        .annotate(day=TruncDate("started_at", tzinfo=UTC))
        .values_list("tenant_id", "day")
        .distinct()
    )
    for tenant_id, day in days:
        start = datetime.combine(day, time.min, tzinfo=UTC)
        groups = (
            records.filter(
                tenant_id=tenant_id, started_at__gte=start, started_at__lt=start + timedelta(days=1)
            )
            .values(*BY)
            .annotate(
                n=Count("id"),
                errors=Count("id", filter=Q(status="error")),
                hits=Count("id", filter=Q(status="cache_hit")),
                prompt=Coalesce(Sum("prompt_tokens"), 0),
                completion=Coalesce(Sum("completion_tokens"), 0),
                cached=Coalesce(Sum("cached_tokens"), 0),
                cost=Coalesce(Sum("cost_micros"), 0),
                unpriced=Count("id", filter=Q(cost_micros__isnull=True)),
            )
        )
        rollups.objects.filter(tenant_id=tenant_id, day=day).delete()
        rollups.objects.bulk_create(
            rollups(
                day=day,
                tenant_id=tenant_id,
                **{k: g[k] for k in BY},
                requests=g["n"],
                errors=g["errors"],
                cache_hits=g["hits"],
                prompt_tokens=g["prompt"],
                completion_tokens=g["completion"],
                cached_tokens=g["cached"],
                cost_micros=g["cost"],
                unpriced=g["unpriced"],
            )
            for g in groups
        )


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0010_priority_classes"),
    ]

    operations = [
        migrations.AddField(
            model_name="dailyusage",
            name="priority",
            field=models.CharField(default="standard", max_length=16),
        ),
        migrations.RunPython(split_by_class, migrations.RunPython.noop),
    ]

"""Prices and engine counter snapshots refer to the fleet app's tables (the same tables as
before: only Django's state changes)."""

import django.db.models.deletion
from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0007_ledger_lean_writes"),
        ("fleet", "0001_initial"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.AlterField(
                    model_name="enginecountersnapshot",
                    name="replica",
                    field=models.ForeignKey(
                        on_delete=django.db.models.deletion.CASCADE,
                        related_name="counter_snapshots",
                        to="fleet.replica",
                    ),
                ),
                migrations.AlterField(
                    model_name="price",
                    name="model",
                    field=models.ForeignKey(
                        on_delete=django.db.models.deletion.PROTECT,
                        related_name="prices",
                        to="fleet.model",
                    ),
                ),
            ],
            database_operations=[],
        ),
    ]

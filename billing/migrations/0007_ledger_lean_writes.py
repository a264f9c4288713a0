"""The ledger's writes made lean (bench/scale.py): no foreign-key constraints (the insert
checks that tenant and key exist), no single-column indexes on tenant and key (every read by
tenant uses (tenant, started_at)), and no ``varchar_pattern_ops`` copy of the request id's
unique index (nothing searches request ids by prefix). All drops: quick at any size."""

import django.db.models.deletion
from django.db import migrations, models


def drop_like_index(apps, schema_editor):
    if schema_editor.connection.vendor != "postgresql":
        return
    with schema_editor.connection.cursor() as cursor:
        cursor.execute(
            "SELECT indexname FROM pg_indexes WHERE tablename = 'billing_usagerecord' "
            "AND indexdef LIKE '%%varchar_pattern_ops%%'"
        )
        for (name,) in cursor.fetchall():
            cursor.execute(f'DROP INDEX IF EXISTS "{name}"')


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0006_usage_route"),
        ("tenants", "0003_invitations"),
    ]

    operations = [
        migrations.AlterField(
            model_name="usagerecord",
            name="api_key",
            field=models.ForeignKey(
                blank=True,
                db_constraint=False,
                db_index=False,
                null=True,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="+",
                to="tenants.apikey",
            ),
        ),
        migrations.AlterField(
            model_name="usagerecord",
            name="tenant",
            field=models.ForeignKey(
                db_constraint=False,
                db_index=False,
                on_delete=django.db.models.deletion.PROTECT,
                related_name="+",
                to="tenants.tenant",
            ),
        ),
        migrations.RunPython(drop_like_index, migrations.RunPython.noop),
    ]

"""The Adapter table moved to the adapters app (adapters 0001): the table stays, only Django's
state changes."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("tenants", "0004_tenant_quotas"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveConstraint(
                    model_name="adapter",
                    name="adapter_unique_version",
                ),
                migrations.DeleteModel(
                    name="Adapter",
                ),
            ],
            database_operations=[],
        ),
    ]

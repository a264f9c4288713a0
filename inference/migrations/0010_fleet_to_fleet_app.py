"""Model, ModelRoute, Pool and Replica moved to the fleet app (fleet 0001): the tables stay,
only Django's state changes."""

from django.db import migrations


class Migration(migrations.Migration):
    dependencies = [
        ("billing", "0008_fleet_foreign_keys"),
        ("inference", "0009_model_routes"),
        ("tenants", "0005_adapter_to_adapters_app"),
    ]

    operations = [
        migrations.SeparateDatabaseAndState(
            state_operations=[
                migrations.RemoveField(
                    model_name="model",
                    name="allowed_tenants",
                ),
                migrations.RemoveField(
                    model_name="pool",
                    name="model",
                ),
                migrations.DeleteModel(
                    name="ModelRoute",
                ),
                migrations.RemoveConstraint(
                    model_name="replica",
                    name="replica_unique_url_per_pool",
                ),
                migrations.RemoveConstraint(
                    model_name="replica",
                    name="replica_unique_name_per_pool",
                ),
                migrations.DeleteModel(
                    name="Model",
                ),
                migrations.RemoveField(
                    model_name="replica",
                    name="pool",
                ),
                migrations.DeleteModel(
                    name="Pool",
                ),
                migrations.DeleteModel(
                    name="Replica",
                ),
            ],
            database_operations=[],
        ),
    ]

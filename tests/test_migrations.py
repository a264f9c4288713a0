"""Upgrading a deployment across the fleet's move (issue 26): the fleet's tables left the
inference app for ``fleet``, ``Adapter`` left ``tenants`` for ``adapters``, by migrations that
change Django's state only. A database with rows made before the move keeps every row, its
id and its relations, and the content types (so permissions and admin history) follow the
models; migrating back and forth again changes nothing."""

from __future__ import annotations

from typing import Any

import pytest
from django.db import connection
from django.db.migrations.executor import MigrationExecutor

pytestmark = pytest.mark.django_db(transaction=True)

BEFORE = [
    ("inference", "0009_model_routes"),
    ("tenants", "0004_tenant_quotas"),
    ("billing", "0007_ledger_lean_writes"),
    ("fleet", None),
    ("adapters", None),
]


def _migrate(targets: list[tuple[str, str | None]]) -> Any:
    """Migrate to ``targets``; the apps of the state reached."""
    executor = MigrationExecutor(connection)
    executor.migrate(targets)
    executor.loader.build_graph()
    reached = [(app, name) for app, name in targets if name is not None]
    return executor.loader.project_state(reached).apps


def _latest() -> list[tuple[str, str | None]]:
    executor = MigrationExecutor(connection)
    leaves: list[tuple[str, str | None]] = executor.loader.graph.leaf_nodes()
    return leaves


def test_rows_made_before_the_fleet_moved_keep_their_ids_relations_and_content_types() -> None:
    latest = _latest()
    old = _migrate(BEFORE)
    try:
        content_type = old.get_model("contenttypes", "ContentType")
        permission = old.get_model("auth", "Permission")
        tenant = old.get_model("tenants", "Tenant").objects.create(slug="acme", name="Acme")
        model = old.get_model("inference", "Model").objects.create(
            name="tiny-chat", served_name="tiny-chat", context_length=1024
        )
        model.allowed_tenants.add(tenant)
        pool = old.get_model("inference", "Pool").objects.create(
            name="online", kind="dedicated", model=model
        )
        replica = old.get_model("inference", "Replica").objects.create(
            pool=pool, name="online-1", url="http://127.0.0.1:9"
        )
        adapter = old.get_model("tenants", "Adapter").objects.create(
            tenant=tenant, name="support", version=1, base_model=model, status="ready"
        )
        types = {
            name: content_type.objects.get_or_create(app_label=app, model=name)[0].pk
            for app, name in [
                ("inference", "model"),
                ("inference", "pool"),
                ("inference", "replica"),
                ("tenants", "adapter"),
            ]
        }
        view_pool = permission.objects.get_or_create(
            content_type_id=types["pool"], codename="view_pool", defaults={"name": "Can view pool"}
        )[0].pk
    finally:
        new = _migrate(latest)

    fleet_model = new.get_model("fleet", "Model").objects.get(pk=model.pk)
    assert fleet_model.name == "tiny-chat"
    assert list(fleet_model.allowed_tenants.values_list("slug", flat=True)) == ["acme"]
    moved_pool = new.get_model("fleet", "Pool").objects.get(pk=pool.pk)
    assert moved_pool.model_id == model.pk
    assert new.get_model("fleet", "Replica").objects.get(pk=replica.pk).pool_id == pool.pk
    moved_adapter = new.get_model("adapters", "Adapter").objects.get(pk=adapter.pk)
    assert (moved_adapter.tenant_id, moved_adapter.base_model_id) == (tenant.pk, model.pk)
    content_type = new.get_model("contenttypes", "ContentType")
    for app, name in [("fleet", "model"), ("fleet", "pool"), ("fleet", "replica")]:
        assert content_type.objects.get(app_label=app, model=name).pk == types[name]
    assert content_type.objects.get(app_label="adapters", model="adapter").pk == types["adapter"]
    assert not content_type.objects.filter(
        app_label="inference", model__in=["model", "pool", "replica"]
    ).exists()
    assert (
        new.get_model("auth", "Permission").objects.get(pk=view_pool).content_type_id
        == (types["pool"])
    )

    # Back and forth once more (a rollback, then the upgrade again): the same rows, the same
    # content types.
    _migrate(BEFORE)
    again = _migrate(latest)
    assert again.get_model("fleet", "Pool").objects.get(pk=pool.pk).name == "online"
    assert (
        again.get_model("contenttypes", "ContentType")
        .objects.get(app_label="fleet", model="pool")
        .pk
        == types["pool"]
    )

"""Reads for models, pools and replicas."""

from __future__ import annotations

from django.db.models import QuerySet

from inference.models import Pool, Replica


def pool_get(*, name: str) -> Pool:
    return Pool.objects.select_related("model").get(name=name)


def replica_list(*, pool: Pool | None = None) -> QuerySet[Replica]:
    replicas = Replica.objects.select_related("pool__model")
    return replicas.filter(pool=pool) if pool is not None else replicas

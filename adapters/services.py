"""Writes: an adapter's upload, validation, verdict, deletion and files. Every change records
an audit event; what the serving catalog must learn is announced (``adapters.signals``)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import shutil
import tempfile
import uuid
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.core.files import File
from django.core.files.storage import default_storage
from django.db import transaction
from django.db.models import Count, Max, Q, Sum
from django.utils import timezone

from adapters import validation
from adapters.models import Adapter, adapter_name_validator
from adapters.signals import adapter_deleted, adapter_ready, adapter_uploaded
from fleet.models import Model
from tenants.models import Tenant, User
from tenants.services import audit_record

logger = logging.getLogger(__name__)


ADAPTER_PARTS = ("archive", "adapter_config", "adapter_model")


def _adapter_staging() -> str:
    return f"adapter-uploads/{uuid.uuid4().hex}/"


@transaction.atomic
def adapter_upload(
    *, tenant: Tenant, name: str, files: Mapping[str, File[Any]], actor: User | None
) -> Adapter:
    """Take an upload (an ``archive``, or ``adapter_config`` + ``adapter_model``) into staging
    and queue its validation. The new version is ``validating`` until then."""
    if set(files) not in ({"archive"}, {"adapter_config", "adapter_model"}):
        raise ValidationError(
            {
                "files": "Send either one archive (.zip or .tar.gz) or both adapter_config "
                "(adapter_config.json) and adapter_model (adapter_model.safetensors)."
            }
        )
    adapter_name_validator(name)
    # The tenant's row lock puts versions in order and makes the quota check exact.
    Tenant.objects.select_for_update().filter(pk=tenant.pk).first()
    latest = Adapter.objects.filter(tenant=tenant, name=name).aggregate(v=Max("version"))["v"]
    size = sum(upload.size or 0 for upload in files.values())
    _adapter_quota_check(tenant=tenant, size=size)
    staging = _adapter_staging()
    try:
        for part, upload in files.items():
            default_storage.save(staging + part, upload)
    except Exception:
        with contextlib.suppress(Exception):  # what reached the storage before it failed
            _storage_remove(staging)
        raise
    adapter = Adapter.objects.create(
        tenant=tenant,
        name=name,
        version=(latest or 0) + 1,
        staging_path=staging,
        size_bytes=size,
        created_by=actor,
    )
    audit_record(
        actor=actor,
        tenant=tenant,
        action="adapter.upload",
        target=adapter,
        details={"name": name, "version": adapter.version, "bytes": size},
    )
    pk = adapter.pk
    transaction.on_commit(lambda: adapter_uploaded.send(sender=Adapter, adapter_id=pk))
    return adapter


def _adapter_quota_check(*, tenant: Tenant, size: int) -> None:
    """Refuse an upload that would take the tenant past its adapter quota. Every version not
    deleted counts, rejected ones too (they stay listed until deleted), but only the bytes
    kept count: a ready version's stored files, a validating one's staged upload."""
    held = Adapter.objects.filter(tenant=tenant, deleted_at__isnull=True).aggregate(
        versions=Count("pk"),
        bytes=Sum("size_bytes", filter=~Q(status=Adapter.Status.REJECTED), default=0),
    )
    max_versions = settings.ADAPTER_MAX_VERSIONS_PER_TENANT
    if held["versions"] >= max_versions:
        raise ValidationError(
            {
                "non_field_errors": f"{tenant.name} already keeps {held['versions']:,} adapter "
                f"versions, the most allowed ({max_versions:,}). Delete versions no longer "
                "needed (rejected ones count too), then upload again."
            }
        )
    max_bytes = settings.ADAPTER_MAX_BYTES_PER_TENANT
    if held["bytes"] + size > max_bytes:
        raise ValidationError(
            {
                "non_field_errors": f"This upload ({size:,} bytes) would bring {tenant.name}'s "
                f"adapters to {held['bytes'] + size:,} bytes, over the quota of "
                f"{max_bytes:,} bytes. Delete versions no longer needed, then upload again."
            }
        )


def _staged_copy(staging: str, workdir: Path) -> dict[str, Path]:
    """The staged upload as local files (storage may be S3), archives unpacked safely."""
    local: dict[str, Path] = {}
    for part in ADAPTER_PARTS:
        if default_storage.exists(staging + part):
            target = workdir / part
            with default_storage.open(staging + part, "rb") as src, target.open("wb") as out:
                shutil.copyfileobj(src, out, 1 << 20)
            local[part] = target
    if "archive" in local:
        out_dir = workdir / "unpacked"
        out_dir.mkdir()
        return validation.unpack(local["archive"], out_dir, max_bytes=settings.ADAPTER_MAX_BYTES)
    return {validation.CONFIG: local["adapter_config"], validation.WEIGHTS: local["adapter_model"]}


def adapter_validate(*, adapter_id: int) -> Adapter:
    """Check the staged upload against the base models that serve LoRA; keep it
    content-addressed if it passes. Either way the staging area is emptied.

    Content that cannot be served ends here, rejected with the reason. Anything else
    (storage unreachable, database gone) raises and keeps the staging area, so that the
    task can run again; it gives up after a bounded number of tries (``adapter_reject``).
    """
    adapter = Adapter.objects.select_related("tenant").get(pk=adapter_id)
    if adapter.status != Adapter.Status.VALIDATING:
        return adapter
    staging = adapter.staging_path
    with tempfile.TemporaryDirectory(prefix="adapter-") as tmp:
        try:
            files = _staged_copy(staging, Path(tmp))
            model, info = _validate_against_models(files)
        except validation.Rejected as exc:
            return adapter_reject(adapter_id=adapter.pk, reason=str(exc))
        digest = hashlib.sha256()
        for part in (validation.CONFIG, validation.WEIGHTS):
            with files[part].open("rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
        sha = digest.hexdigest()
        home = f"adapters/{sha}/"
        for part in (validation.CONFIG, validation.WEIGHTS):
            if not default_storage.exists(home + part):
                with files[part].open("rb") as f:
                    default_storage.save(home + part, File(f))
    size = sum(default_storage.size(home + p) for p in (validation.CONFIG, validation.WEIGHTS))
    with transaction.atomic():
        # Deleted, or given up on by the sweep, while it was being validated: keep nothing
        # (and never bring it back).
        adapter = Adapter.objects.select_for_update().select_related("tenant").get(pk=adapter.pk)
        if adapter.deleted_at is not None or adapter.status != Adapter.Status.VALIDATING:
            if adapter.status == Adapter.Status.VALIDATING:
                adapter.status = Adapter.Status.REJECTED
                adapter.reason = "Deleted while it was being validated."
                adapter.validated_at = timezone.now()
                adapter.save(update_fields=_VERDICT_FIELDS)
            gone = adapter

            def discard() -> None:
                _staging_discard(gone)
                _files_unshared(sha)

            transaction.on_commit(discard)
            return adapter
        adapter.status = Adapter.Status.READY
        adapter.sha256 = sha
        adapter.base_model = model
        adapter.rank, adapter.alpha = info.rank, info.alpha
        adapter.target_modules = list(info.target_modules)
        adapter.size_bytes = size
        adapter.validated_at = timezone.now()
        adapter.save(
            update_fields=[
                *_VERDICT_FIELDS,
                "sha256",
                "base_model",
                "rank",
                "alpha",
                "target_modules",
                "size_bytes",
            ]
        )
    audit_record(
        actor=None,
        tenant=adapter.tenant,
        action="adapter.ready",
        target=adapter,
        details={"sha256": sha, "rank": info.rank, "base_model": model.name},
    )
    _staging_discard(adapter)
    adapter_ready.send(sender=Adapter, adapter=adapter)  # servable from now on
    return adapter


def _validate_against_models(files: dict[str, Path]) -> tuple[Model, validation.AdapterInfo]:
    candidates = [m for m in Model.objects.filter(supports_lora=True) if m.architecture]
    if not candidates:
        raise validation.Rejected("No model served here accepts LoRA adapters.")
    problems = []
    for model in candidates:
        pools = list(model.pools.all())
        max_rank = min((p.max_lora_rank for p in pools), default=8)
        names = [model.name, model.served_name, str(model.architecture.get("_name_or_path", ""))]
        try:
            info = validation.validate(
                files,
                base_names=[n for n in names if n],
                max_rank=max_rank,
                arch=validation.Architecture.from_config(model.architecture),
            )
            return model, info
        except validation.Rejected as exc:
            problems.append(str(exc))
    raise validation.Rejected(problems[0])


# Not deleted_at (a delete meanwhile stands), nor staging_path: it is cleared once the
# staging area is really gone (``_staging_discard``).
_VERDICT_FIELDS = ["status", "reason", "validated_at"]


def adapter_reject(*, adapter_id: int, reason: str) -> Adapter:
    """The verdict for a version that will not be served, with ``reason`` for the person who
    uploaded it; its staging area goes. A version that already has a verdict keeps it."""
    with transaction.atomic():
        adapter = Adapter.objects.select_for_update().select_related("tenant").get(pk=adapter_id)
        if adapter.status != Adapter.Status.VALIDATING:
            return adapter
        adapter.status = Adapter.Status.REJECTED
        adapter.reason = reason[:500]
        adapter.validated_at = timezone.now()
        adapter.save(update_fields=_VERDICT_FIELDS)
        audit_record(
            actor=None,
            tenant=adapter.tenant,
            action="adapter.rejected",
            target=adapter,
            details={"reason": adapter.reason},
        )
    _staging_discard(adapter)
    return adapter


def adapters_stuck_reject() -> int:
    """The periodic sweep: reject the versions still ``validating`` after
    ADAPTER_VALIDATION_DEADLINE_MINUTES (a worker killed at the hard time limit or lost, a
    task message lost with Redis), and empty the staging areas that storage failed to give
    up at the verdict. Returns how many versions it rejected."""
    minutes = settings.ADAPTER_VALIDATION_DEADLINE_MINUTES
    stuck = list(
        Adapter.objects.filter(
            status=Adapter.Status.VALIDATING,
            created_at__lt=timezone.now() - timedelta(minutes=minutes),
        ).values_list("pk", flat=True)
    )
    for adapter_id in stuck:
        adapter_reject(
            adapter_id=adapter_id,
            reason=f"Validation did not finish within {minutes} minutes (not because of the "
            "adapter); upload it again.",
        )
    leftovers = Adapter.objects.exclude(status=Adapter.Status.VALIDATING).exclude(staging_path="")
    for adapter in leftovers[:500]:
        _staging_discard(adapter)
    return len(stuck)


def _staging_discard(adapter: Adapter) -> None:
    """Empty a version's staging area once it has a verdict. Storage that fails now leaves
    ``staging_path`` set, for the periodic sweep to try again."""
    staging = adapter.staging_path
    if not staging:
        return
    try:
        _storage_remove(staging)
    except Exception:
        logger.warning("adapter %s: staging %s not removed", adapter.pk, staging, exc_info=True)
        return
    Adapter.objects.filter(pk=adapter.pk, staging_path=staging).update(staging_path="")
    adapter.staging_path = ""


def _storage_remove(prefix: str) -> None:
    if not prefix:
        return
    dirs, files = default_storage.listdir(prefix) if default_storage.exists(prefix) else ([], [])
    for name in files:
        default_storage.delete(prefix + name)
    for name in dirs:
        _storage_remove(f"{prefix}{name}/")
    with contextlib.suppress(OSError, NotImplementedError):
        default_storage.delete(prefix.rstrip("/"))


@transaction.atomic
def adapter_delete(*, adapter: Adapter, actor: User | None) -> Adapter:
    """Delete one version. Its files go when no other adapter (any tenant) shares them."""
    adapter = Adapter.objects.select_for_update().get(pk=adapter.pk)
    if adapter.deleted_at:
        return adapter
    adapter.deleted_at = timezone.now()
    adapter.save(update_fields=["deleted_at"])
    audit_record(actor=actor, tenant=adapter.tenant, action="adapter.delete", target=adapter)
    if adapter.status == Adapter.Status.READY:
        # Gateways stop routing to it within a second; the fleet then unloads it from the
        # engines and removes its files (adapter_files_remove) once no request uses it.
        adapter_deleted.send(sender=Adapter, adapter=adapter)
    return adapter


def adapter_files_remove(*, adapter: Adapter) -> None:
    """Remove a deleted adapter's files, unless another live adapter (any tenant, same
    content) shares them."""
    _files_unshared(adapter.sha256)


def _files_unshared(sha: str) -> None:
    if sha and not Adapter.objects.filter(sha256=sha, deleted_at__isnull=True).exists():
        _storage_remove(f"adapters/{sha}/")
        shutil.rmtree(Path(settings.ADAPTER_CACHE_DIR) / sha, ignore_errors=True)


def adapter_local_dir(*, adapter: Adapter) -> str:
    """A directory holding a ready adapter's two files on this machine's filesystem: what an
    engine's ``load_lora_adapter`` takes as ``lora_path`` (engines must see the same path).

    With filesystem storage, where the storage keeps them. With storage that has no local
    paths (S3), a copy in ``ADAPTER_CACHE_DIR`` (a volume shared with the engines), fetched
    from storage once, content-addressed like the storage itself.
    """
    home = f"adapters/{adapter.sha256}/"
    with contextlib.suppress(NotImplementedError):
        local = Path(default_storage.path(home.rstrip("/")))
        if all((local / part).is_file() for part in (validation.CONFIG, validation.WEIGHTS)):
            return str(local)
    cache = Path(settings.ADAPTER_CACHE_DIR) / adapter.sha256
    if not all((cache / part).is_file() for part in (validation.CONFIG, validation.WEIGHTS)):
        cache.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{adapter.sha256}-", dir=cache.parent))
        try:
            for part in (validation.CONFIG, validation.WEIGHTS):
                with (
                    default_storage.open(home + part, "rb") as src,
                    (staging / part).open("wb") as out,
                ):
                    shutil.copyfileobj(src, out, 1 << 20)
            with contextlib.suppress(OSError):  # another process filled it meanwhile: fine
                staging.rename(cache)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return str(cache)

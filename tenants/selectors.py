"""Reads. Every tenant-owned row is reached through a function that takes the tenant."""

from __future__ import annotations

from datetime import datetime

from django.db.models import Q, QuerySet
from django.utils import timezone

from tenants.access import ROLE_PERMS, STAFF_PERMS, TenantAccess
from tenants.keys import digest_matches, key_parse
from tenants.models import ApiKey, AuditEvent, Invitation, Membership, Tenant, User


def tenant_list_for_user(*, user: User) -> QuerySet[Tenant]:
    if user.is_staff:
        return Tenant.objects.all()
    return Tenant.objects.filter(memberships__user=user)


def tenant_access_get(*, user: User, slug: str) -> TenantAccess:
    """The tenant and what ``user`` may do in it.

    Raises ``Tenant.DoesNotExist`` when the tenant does not exist *or* the user is neither
    a member nor staff: outsiders cannot tell the two apart.
    """
    membership = (
        Membership.objects.select_related("tenant").filter(user=user, tenant__slug=slug).first()
    )
    if user.is_staff:
        tenant = membership.tenant if membership else Tenant.objects.get(slug=slug)
        return TenantAccess(
            tenant=tenant,
            role=membership.role if membership else None,
            perms=STAFF_PERMS,
            is_staff=True,
        )
    if membership is None:
        raise Tenant.DoesNotExist(f"No tenant {slug!r} for this user")
    return TenantAccess(
        tenant=membership.tenant,
        role=membership.role,
        perms=ROLE_PERMS[membership.role],
        is_staff=False,
    )


def tenant_get_by_slug(*, slug: str) -> Tenant:
    """For commands and platform code; never for a request's user input (use access_get)."""
    return Tenant.objects.get(slug=slug)


def membership_list(*, tenant: Tenant) -> QuerySet[Membership]:
    return Membership.objects.filter(tenant=tenant).select_related("user")


def membership_get(*, tenant: Tenant, membership_id: int) -> Membership:
    return Membership.objects.select_related("user", "tenant").get(tenant=tenant, id=membership_id)


def invitation_list_open(*, tenant: Tenant) -> QuerySet[Invitation]:
    from django.utils import timezone

    return Invitation.objects.filter(
        tenant=tenant,
        accepted_at__isnull=True,
        revoked_at__isnull=True,
        expires_at__gt=timezone.now(),
    ).select_related("created_by")


def invitation_get(*, tenant: Tenant, invitation_id: int) -> Invitation:
    return Invitation.objects.select_related("tenant", "created_by").get(
        tenant=tenant, id=invitation_id
    )


def membership_owner_count(*, tenant: Tenant) -> int:
    return Membership.objects.filter(tenant=tenant, role="owner").count()


def api_key_list(*, tenant: Tenant) -> QuerySet[ApiKey]:
    return ApiKey.objects.filter(tenant=tenant).select_related("created_by")


def api_keys_active(
    *, tenant: Tenant, scope: str, created_by: User | None = None
) -> QuerySet[ApiKey]:
    """The tenant's keys that work now and carry ``scope`` (only those ``created_by`` made,
    if given), by name: what a member may run a batch as from the dashboard."""
    now = timezone.now()
    keys = ApiKey.objects.filter(
        Q(expires_at__isnull=True) | Q(expires_at__gt=now),
        tenant=tenant,
        revoked_at__isnull=True,
        scopes__contains=[scope],
    )
    if created_by is not None:
        keys = keys.filter(created_by=created_by)
    return keys.order_by("name", "id")


def api_key_get(*, tenant: Tenant, key_id: int) -> ApiKey:
    return ApiKey.objects.select_related("created_by", "tenant").get(tenant=tenant, id=key_id)


def api_key_authenticate(*, raw_key: str, now: datetime | None = None) -> ApiKey | None:
    """The active key (with its tenant) that ``raw_key`` is, or None.

    None for anything malformed, unknown, revoked, expired, or of a suspended tenant.
    """
    parsed = key_parse(raw_key)
    if parsed is None:
        return None
    key = ApiKey.objects.select_related("tenant").filter(prefix=parsed.prefix).first()
    if key is None or not digest_matches(key.secret_hash, parsed.digest):
        return None
    if not key.is_active_at(now) or not key.tenant.is_active:
        return None
    return key


def platform_audit_event_list(
    *, actions: tuple[str, ...], pool: str | None = None
) -> QuerySet[AuditEvent]:
    """The platform's own changes (no tenant: routes, pools, replicas, list prices), newest
    first: those whose action starts with one of ``actions``; only those about ``pool`` (the
    pool itself, or one of its replicas) if given."""
    match = Q()
    for action in actions:
        match |= Q(action__startswith=action)
    events = AuditEvent.objects.filter(match, tenant__isnull=True)
    if pool is not None:
        events = events.filter(Q(target_type="pool", target_label=pool) | Q(details__pool=pool))
    return events


def audit_event_list(
    *, tenant: Tenant, action: str | None = None, since: datetime | None = None
) -> QuerySet[AuditEvent]:
    events = AuditEvent.objects.filter(tenant=tenant)
    if action:
        events = events.filter(action__startswith=action)
    if since is not None:
        events = events.filter(created_at__gte=since)
    return events

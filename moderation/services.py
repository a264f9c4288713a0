"""Writes: a tenant's policy saved (and published to the gateways), events stored."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, cast

import msgspec
import redis
from django.db import transaction
from django.db.models import Q

from controlplane.redis import redis_blocking, redis_sync
from fleet.models import Model
from moderation.categories import CATEGORIES
from moderation.models import ModerationEvent, ModerationPolicy
from moderation.policy import ACTIONS, PolicyInvalid, min_step, policy_check
from moderation.publishing import policies_publish, policy_spec
from tenants.models import Tenant, User
from tenants.services import audit_record

log = logging.getLogger(__name__)

EVENTS_STREAM = "ip:moderation:events"
FLUSH_BATCH = 1000
DEFAULT_THRESHOLD = 0.8

# What a save may change; the rest of the row is the service's.
FIELDS = (
    "enabled",
    "check_input",
    "check_output",
    "action",
    "categories",
    "deny_terms",
    "regexes",
    "pii_action",
    "classifier",
    "guard_model",
    "output_mode",
    "window_tokens",
    "overlap_tokens",
    "fail_open",
    "budget_ms",
    "store_text",
)


def _publish_quietly() -> None:
    try:
        policies_publish()
    except redis.RedisError:
        # The periodic publish (moderation.tasks) retries within a minute.
        log.warning("moderation policies not published: Redis unavailable", exc_info=True)


def default_categories(action: str) -> dict[str, dict[str, Any]]:
    return {name: {"threshold": DEFAULT_THRESHOLD, "action": action} for name in CATEGORIES}


@transaction.atomic
def moderation_policy_set(
    *, tenant: Tenant, changes: Mapping[str, Any], actor: User | None
) -> ModerationPolicy:
    """Create or change the tenant's policy. Raises ``PolicyInvalid`` (with the field and the
    reason) for a policy that cannot work; nothing is saved then. Every web process applies
    the change within two seconds (announced on commit; ``moderation.policy_view`` reads it)."""
    unknown = set(changes) - set(FIELDS)
    if unknown:
        raise PolicyInvalid(sorted(unknown)[0], "not a policy field")
    policy = ModerationPolicy.objects.select_for_update().filter(tenant=tenant).first()
    created = policy is None
    if policy is None:
        action = str(changes.get("action", "block"))
        policy = ModerationPolicy(tenant=tenant, categories=default_categories(action))
    for name, value in changes.items():
        setattr(policy, name, value)
    if policy.action not in ACTIONS:
        raise PolicyInvalid("action", f"must be one of {', '.join(ACTIONS)}")
    if policy.guard_model and not _guard_open_to(tenant, policy.guard_model):
        # One answer for a model that does not exist and one another tenant keeps private.
        raise PolicyInvalid(
            "guard_model",
            f"no classification model named {policy.guard_model!r} that this organization may use",
        )
    if "window_tokens" not in changes and "overlap_tokens" not in changes:
        # Saved before windows had to move on by a quarter of themselves: the gateways read
        # it with that floor already (window_step); a save of other fields keeps it readable.
        most = policy.window_tokens - min_step(policy.window_tokens)
        policy.overlap_tokens = min(policy.overlap_tokens, max(0, most))
    policy.deny_terms = _dedupe([str(t).strip() for t in policy.deny_terms or ()])
    policy.regexes = _dedupe([str(r) for r in policy.regexes or ()])
    policy.updated_at = datetime.now(UTC)
    try:
        policy_check(policy_spec(policy))
    except (msgspec.ValidationError, KeyError, TypeError, ValueError) as exc:
        if isinstance(exc, PolicyInvalid):
            raise
        raise PolicyInvalid("categories", f"not a valid category rule: {exc}") from exc
    policy.save()
    audit_record(
        actor=actor,
        tenant=tenant,
        action="moderation.policy_created" if created else "moderation.policy_changed",
        target=policy,
        details={k: v for k, v in changes.items() if k not in ("deny_terms", "regexes")},
    )
    transaction.on_commit(_publish_quietly)
    return policy


def _guard_open_to(tenant: Tenant, name: str) -> bool:
    """A classification model the tenant may call: public, or private and allowed to it."""
    models = Model.objects.filter(name=name, task=Model.Task.CLASSIFY)
    return models.filter(Q(is_public=True) | Q(allowed_tenants=tenant)).exists()


def _dedupe(values: list[str]) -> list[str]:
    return list(dict.fromkeys(v for v in values if v))


Entries = list[tuple[bytes, dict[bytes, bytes]]]


def moderation_events_flush(*, max_batches: int = 20) -> int:
    """Move the gateways' events from the Redis stream into Postgres. Idempotent (each
    event's stream id is unique in the table), so flushers may overlap; entries are deleted
    only once stored."""
    client = redis_sync()
    stored = 0
    for _ in range(max_batches):
        entries = cast(Entries, client.xrange(EVENTS_STREAM, count=FLUSH_BATCH))
        if not entries:
            break
        stored += _events_store(client, entries)
    return stored


class ModerationEventsDrain:
    """The events' consumer in the drains process (``controlplane.drains``): a read that
    blocks until a gateway records an event (``XREAD BLOCK`` after the last one it saw), so
    events reach Postgres at once and an idle platform costs one read per block. Several
    may run: what two of them read is stored once (the stream id is unique in the table)."""

    name = "moderation-events"

    # Every this many empty reads, a look at the stream's length: events it holds that the
    # reads do not return (ids below the last seen: a Redis restarted with its clock behind)
    # are read again from the start.
    LOOK_EVERY = 6

    def __init__(self) -> None:
        self.last = "0-0"  # from the start: what is in the stream was not stored
        self.empty = 0

    def reset(self) -> None:
        self.last = "0-0"

    def step(self, block_seconds: float) -> int:
        client = redis_blocking()
        read = client.xread(
            {EVENTS_STREAM: self.last}, count=FLUSH_BATCH, block=max(1, int(block_seconds * 1000))
        )
        if not read:
            self.empty += 1
            if self.empty % self.LOOK_EVERY == 0 and client.xlen(EVENTS_STREAM):
                self.last = "0-0"
            return 0
        entries = cast(Entries, cast(list[Any], read)[0][1])
        stored = _events_store(client, entries)
        self.last = entries[-1][0].decode()
        return stored


def _events_store(client: redis.Redis, entries: Entries) -> int:
    """Store ``entries`` (the unreadable ones logged and dropped), then delete them."""
    rows = []
    for entry_id, fields in entries:
        try:
            data = msgspec.json.decode(fields[b"e"])
            rows.append(
                ModerationEvent(
                    event_id=entry_id.decode(),
                    tenant_id=int(data["tenant_id"]),
                    request_id=str(data["request_id"])[:64],
                    where=data["where"],
                    action=data["action"],
                    categories=list(data.get("categories") or ()),
                    rules=list(data.get("rules") or ()),
                    failure=str(data.get("failure") or "")[:300],
                    text=str(data.get("text") or "")[:4000],
                    key_prefix=str(data.get("key_prefix") or "")[:32],
                    created_at=datetime.fromtimestamp(float(data["at"]), tz=UTC),
                )
            )
        except (KeyError, TypeError, ValueError, msgspec.DecodeError):
            log.error("moderation event unreadable, dropped: %r", fields)
    tenants = set(
        Tenant.objects.filter(pk__in={r.tenant_id for r in rows}).values_list("pk", flat=True)
    )
    ModerationEvent.objects.bulk_create(
        [r for r in rows if r.tenant_id in tenants], ignore_conflicts=True
    )
    client.xdel(EVENTS_STREAM, *[entry_id for entry_id, _ in entries])
    return len(rows)

"""Every tenant's policy, as the gateways hold it, in Redis: ``ip:{moderation}:policies`` (the
snapshot, ``moderation.policy.Snapshot``) and ``ip:{moderation}:version`` (one slot on a
cluster), each change announced on ``ip:moderation:changed:db<N>`` (sharded pub/sub): the
gateways then look at the version and fetch the snapshot only when it changed."""

from __future__ import annotations

import time

import msgspec

from controlplane.redis import announce, applied_wait, redis_sync
from moderation.models import ModerationPolicy
from moderation.policy import CategoryRule, PolicySpec, Snapshot

POLICIES_KEY = "ip:{moderation}:policies"
VERSION_KEY = "ip:{moderation}:version"
CHANNEL = "ip:moderation:changed"
TAG = "moderation"  # its announcements' reach and who applied them (``applied_wait``)
PUBLISH_LOCK = "ip:moderation:publish-lock"


def policy_spec(policy: ModerationPolicy) -> PolicySpec:
    return PolicySpec(
        version=int(policy.updated_at.timestamp() * 1_000_000) if policy.updated_at else 0,
        check_input=policy.check_input,
        check_output=policy.check_output,
        action=policy.action,  # type: ignore[arg-type]
        categories={
            name: CategoryRule(threshold=float(rule["threshold"]), action=rule["action"])
            for name, rule in (policy.categories or {}).items()
        },
        deny_terms=list(policy.deny_terms or ()),
        regexes=list(policy.regexes or ()),
        pii_action=policy.pii_action,  # type: ignore[arg-type]
        classifier=policy.classifier,
        guard_model=policy.guard_model,
        output_mode=policy.output_mode,  # type: ignore[arg-type]
        window_tokens=policy.window_tokens,
        overlap_tokens=policy.overlap_tokens,
        fail_open=policy.fail_open,
        budget_ms=policy.budget_ms,
        store_text=policy.store_text,
    )


def policies_build() -> Snapshot:
    return {p.tenant_id: policy_spec(p) for p in ModerationPolicy.objects.filter(enabled=True)}


def policies_applied(*, within: float) -> int:
    """Wait until every process holding the policies has applied the version last
    announced (``controlplane.redis.applied_wait``)."""
    return applied_wait(TAG, VERSION_KEY, within=within, what="the moderation policies")


def policies_publish() -> tuple[int, Snapshot]:
    """Publish every policy; returns (the version, the snapshot). Called after each change
    (on commit) and by a periodic task, so a publish Redis missed heals within a minute."""
    client = redis_sync()
    # One publisher at a time, each building inside the lock: a periodic publish that read
    # the database just before a change committed cannot write its stale copy after the
    # change's own publish (which runs on commit, so it waits here and writes last).
    with client.lock(PUBLISH_LOCK, timeout=30, blocking_timeout=30):
        snapshot = policies_build()
        encoded = msgspec.json.encode(snapshot)
        current, known = client.mget(POLICIES_KEY, VERSION_KEY)
        if current == encoded and known is not None:
            return int(known), snapshot  # unchanged: the gateways keep what they compiled
        version = time.time_ns()
        pipe = client.pipeline(transaction=True)
        pipe.set(POLICIES_KEY, encoded)
        pipe.set(VERSION_KEY, version)
        pipe.execute()
        announce(CHANNEL, version, tag=TAG)  # the gateways look at the version when told
    return version, snapshot

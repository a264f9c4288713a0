"""API key format: ``sk-ip-<prefix>_<secret>``.

The prefix (12 hex characters) is public: it is stored, shown in lists and used to find the
row. The secret never leaves the response that created it; the database keeps the SHA-256 of
the whole key. A fast hash is right here: the secret is 256 random bits, so there is nothing
to brute-force, and the hot path checks a key in microseconds.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

KEY_TAG = "sk-ip-"
# The tenants whose keys were used since the last flush: sets, a tenant in the one of its id
# modulo this many (on a cluster, every request's end names its tenant: spread over slots).
LAST_USED_SETS = 16


def last_used_tenants_key(index: int) -> str:
    """The set of tenants number ``index`` (a tenant id modulo ``LAST_USED_SETS``)."""
    return f"ip:key_last_used:tenants:{index % LAST_USED_SETS}"


# Before the per-tenant hashes, one hash for every key (flushed after an upgrade, then gone).
LEGACY_LAST_USED_KEY = "ip:key_last_used"


def last_used_key(tenant_id: int) -> str:
    """When each of a tenant's keys was last used (prefix -> epoch seconds): a Redis hash in
    the tenant's slot, stamped by the gateway's limits script on every request; each
    request's end adds the tenant to its set (``last_used_tenants_key``), and
    ``services.api_keys_last_used_flush`` writes the stamps to the rows."""
    return f"ip:key_last_used:{{t:{tenant_id}}}"


PREFIX_LENGTH = 12


@dataclass(frozen=True)
class ParsedKey:
    prefix: str
    digest: str


def key_generate() -> tuple[str, str, str]:
    """A new key: (full key, prefix, sha256 hex digest of the full key)."""
    prefix = secrets.token_hex(PREFIX_LENGTH // 2)
    full = f"{KEY_TAG}{prefix}_{secrets.token_urlsafe(32)}"
    return full, prefix, key_digest(full)


def key_digest(full_key: str) -> str:
    return hashlib.sha256(full_key.encode()).hexdigest()


def key_parse(raw: str) -> ParsedKey | None:
    """The prefix and digest of something that looks like one of our keys, else None."""
    if not raw.startswith(KEY_TAG) or len(raw) > 200:
        return None
    body = raw[len(KEY_TAG) :]
    prefix, sep, secret = body.partition("_")
    if not sep or len(prefix) != PREFIX_LENGTH or not secret:
        return None
    return ParsedKey(prefix=prefix, digest=key_digest(raw))


def digest_matches(stored: str, presented: str) -> bool:
    return hmac.compare_digest(stored, presented)

"""The engines' prefix cache, partitioned by tenant.

vLLM reuses the KV blocks of any earlier prompt with the same prefix, and says so in
``usage.prompt_tokens_details.cached_tokens``: without a partition, a tenant could learn
whether anyone else sent a given text (send it, read the count; no timing needed). Every
request the platform sends an engine (chat, completions, batch lines, with or without an
adapter) therefore carries a ``cache_salt`` derived from the tenant with the server's secret.
vLLM puts the salt into the hash of the prompt's first block, so the whole prefix chain is
the tenant's own; the tenant's own repeated prefixes still hit. A client's own
``cache_salt`` narrows its partition further (combined with the tenant's, never replacing
it). The price: tenants never share the blocks of a common system prompt.
"""

from __future__ import annotations

import hashlib
from functools import lru_cache

from django.utils.crypto import salted_hmac

# vLLM takes 1-128 characters without '/', '\', '@' or NUL: hex, 128 bits of it.
SALT_HEX = 32


@lru_cache(maxsize=65536)
def tenant_salt(tenant_id: int) -> str:
    """The tenant's partition: an HMAC of its id under SECRET_KEY (shared by every web and
    worker process of a deployment; rotating it only makes every cache cold once)."""
    digest = salted_hmac("inferplane.cache-salt", str(tenant_id), algorithm="sha256")
    return digest.hexdigest()[:SALT_HEX]


def cache_salt(tenant_id: int, client_salt: str | None = None) -> str:
    """The salt sent to the engine: the tenant's, narrowed by the client's if it sent one."""
    salt = tenant_salt(tenant_id)
    if not client_salt:
        return salt
    combined = hashlib.sha256(f"{salt}:{client_salt}".encode()).hexdigest()
    return combined[:SALT_HEX]


def salted_prefix(salt: str, prefix_hash: str) -> str:
    """The key prefix-affine routing uses: the same partition as the cache it aims at."""
    return hashlib.blake2b(f"{salt}:{prefix_hash}".encode(), digest_size=8).hexdigest()

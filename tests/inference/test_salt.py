"""The prefix-cache partition's salt (the live check is tests/inference/test_isolation.py)."""

from __future__ import annotations

from inference.gateway.salt import cache_salt, tenant_salt


def test_a_client_salt_narrows_and_never_replaces_the_tenants() -> None:
    """The salt the engine gets is the tenant's (an HMAC under SECRET_KEY), combined with the
    client's: even another tenant's own salt, sent as the client's, is not that tenant's."""
    assert cache_salt(1) == tenant_salt(1) != tenant_salt(2)
    assert cache_salt(1, tenant_salt(2)) not in {tenant_salt(1), tenant_salt(2)}
    assert cache_salt(1, "x") != cache_salt(2, "x")
    for salt in (cache_salt(1), cache_salt(1, "a/b@c\\d")):
        assert len(salt) == 32 and int(salt, 16) >= 0  # what vLLM accepts: hex

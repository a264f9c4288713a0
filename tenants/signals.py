"""What tenants announce, for the layers above to act on: sent inside the transaction that made
the change, so a receiver can record its work with it (the key cache's outbox does)."""

from django.dispatch import Signal

# What a gateway may have cached about keys is stale: one key (``prefix=``) or every key of
# a tenant (``tenant_id=``), because it was revoked, rotated, re-limited or its tenant changed.
keys_changed = Signal()

# A tenant's response cache was turned on or off (``tenant_id``): what it held is forgotten,
# so that turning it on again serves nothing kept before (inference.receivers).
response_cache_reset = Signal()

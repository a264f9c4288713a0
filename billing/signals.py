"""What billing announces, for the layers above to act on (sent inside the transaction)."""

from django.dispatch import Signal

# A price was set: the serving catalog, which the gateway prices spend budgets with, is stale.
prices_changed = Signal()

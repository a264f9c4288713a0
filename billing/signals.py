"""What billing announces, for the layers above and for its own tasks to act on: sent inside
the transaction (``prices_changed``, ``adapters_used``), or once it is committed (the
invoices', which queue Stripe's side)."""

from django.dispatch import Signal

# A price was set: the serving catalog, which the gateway prices spend budgets with, is stale.
prices_changed = Signal()
# Records of adapters' requests reached the ledger: ``latest={(tenant_id, name, version):
# finished_at}``, the latest use of each (``adapters.receivers`` stamps ``last_used_at``).
adapters_used = Signal()
# An invoice was finalized with something to pay, or voided after it went to Stripe: the
# Stripe side follows (sent once the change is committed; ``billing.tasks`` queues it, the
# tasks importing the services and never the other way). ``invoice_id=``.
invoice_finalized = Signal()
invoice_voided = Signal()

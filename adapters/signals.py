"""What adapters announce, for the layers above to act on (the serving catalog, the engines):
sent inside the transaction that made the change; receivers defer their work to its commit."""

from django.dispatch import Signal

# A version became servable (ready) or stopped being servable (deleted): the serving
# catalog must change. ``adapter=`` the Adapter row.
adapter_ready = Signal()
adapter_deleted = Signal()

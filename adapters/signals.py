"""What adapters announce, for the layers above to act on (the serving catalog, the engines):
sent inside the transaction that made the change; receivers defer their work to its commit."""

from django.dispatch import Signal

# A version became servable (ready) or stopped being servable (deleted): the serving
# catalog must change. ``adapter=`` the Adapter row.
adapter_ready = Signal()
adapter_deleted = Signal()
# A version was uploaded and waits for its validation (sent once the upload is committed;
# ``adapters.tasks`` queues it: the tasks import the services, never the other way).
# ``adapter_id=``.
adapter_uploaded = Signal()

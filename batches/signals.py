"""What a batch's changes of state ask of the workers, announced once the change is committed
(``transaction.on_commit``). The services send them; ``batches.tasks`` receives them and
queues the task: the tasks import the services, never the other way (``make imports``)."""

from django.dispatch import Signal

# The batch has work for a worker: its validation (``validate=True``) or lines to run.
# ``batch_id=``. If the broker cannot take it now, the sweeper will.
batch_work_waiting = Signal()
# The batch's ending began and its files wait to be written (an expiry). ``batch_id=``.
batch_files_waiting = Signal()

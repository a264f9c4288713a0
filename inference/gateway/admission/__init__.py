"""Token-weighted fair admission (Virtual Token Counter) over Redis, global across processes.

Per pool, under one hash tag (``ip:{p:<pool>}:``), with ``<b>`` a priority band (0 first):
  counters:<b>  hash   tenant -> virtual token counter (weighted service received in the band)
  active        hash   tenant -> requests running (or holding a slot)
  idle_since    hash   tenant -> when it last had nothing running
  holds         zset   "tenant|replica|rid" -> expiry: slots kept for a returning tenant
  backlog:<b>   zset   the band's backlogged tenants, scored by counter
  q:<b>:<tenant> list  that tenant's waiting request ids in the band (``fcfs:<b>``: one list)
  passed        hash   band -> admissions of higher bands since it last had one, while it waited
  req:<rid>     hash   tenant, weight, estimate, sequences, process, prefix, deadline, state,
                       replica, band
  inflight      zset   admitted request ids by lease expiry (renewed while they run)
  replicas      hash   ready replica id -> capacity (``catalog_publish`` writes it)
  rload         hash   replica id -> sequences in flight (a request runs prompts x n of them)
  grants:<proc> list   admitted request ids for the web process that holds the connection
                       ("rid|replica"), or lent ones it lost ("!rid")
  lend          string the percent of the pool's capacity it lends batch lines (the catalog's)
  lent          zset   request ids running on lent room, in the order lent (lent_serial)
  lent_seqs     string the sequences they run
  lending       hash   lent / reclaimed: how many requests were lent room, and lost it

Capacity counts sequences, not requests: a request of 8 prompts with n=2 takes 16 of a
replica's ``max_inflight`` slots (one larger than a replica is refused before it gets here),
so no request shape can put more work on an engine than its share.

Bands are served in strict order (a request's band is its priority class, see
``inference.gateway.priority``), except for the starvation guard: a lower band passed over
``SHARE - 1`` admissions in a row while it waited takes the next one, so a flood at the top
leaves every lower band at least one admission in ``SHARE``. Inside a band, admitting picks
the backlogged tenant with the smallest counter, charges it
``w_in·prompt_estimate / weight`` and routes the request (least loaded replica; among
near-least-loaded ones, rendezvous hashing of the prompt's prefix for cache affinity; for a
LoRA adapter, the least loaded replica already holding it, see ``inference.gateway.lora``).
Output tokens are charged as they stream (PROGRESS); COMPLETE reconciles the estimate with
the engine's count, frees the slot and admits the next request. A tenant that becomes
backlogged after being idle (nothing queued, nothing running) has its counter lifted to the
smallest backlogged counter, so idle time earns no credit. When a request ends and its
tenant is owed service but has nothing queued yet (a client about to send its next request),
the slot is held for that tenant for HOLD_MS before anyone else gets it. Leases of a crashed
process expire and are reaped.

An online pool may lend its idle room to batch lines (``borrow``, ``lend.lua``): granted at
once in the lowest band while nothing waits in any band and the lent sequences stay within the
pool's share, else refused at once (the line waits in its spot pool's queue, asking
``lendable`` meanwhile). A request that finds no
room takes lent room back first (``reclaim``): the newest lent request's slot is freed in the
same script and its process told, which aborts it on the engine.

The package's modules: ``scripts`` (the numbers and the Lua scripts, under
``inference/gateway/lua/admission/``), ``grants`` (what a process keeps: the grants it waits
for, the leases it renews, its listener), ``slots`` (``Admission``: a request admitted, lent
room, given back, rerouted) and ``readers`` (the state for the dashboard and commands).
Only this package builds the keys above.
"""

from inference.gateway.admission.readers import QueueState, adapter_in_use, queue_state
from inference.gateway.admission.scripts import (
    BACKFILL_MS,
    BANDS,
    DEFAULT_BAND,
    HOLD_MS,
    SHARE,
    W_IN,
    W_OUT,
)
from inference.gateway.admission.slots import (
    Admission,
    Alongside,
    CatalogMissing,
    NotTaken,
    admission,
)

__all__ = [
    "BACKFILL_MS",
    "BANDS",
    "DEFAULT_BAND",
    "HOLD_MS",
    "SHARE",
    "W_IN",
    "W_OUT",
    "Admission",
    "Alongside",
    "CatalogMissing",
    "NotTaken",
    "QueueState",
    "adapter_in_use",
    "admission",
    "queue_state",
]

"""Admission's numbers and its Lua scripts (one file each under
``inference/gateway/lua/admission/``; the numbers are given to them from here)."""

from __future__ import annotations

from inference.gateway.lua import Script
from tenants.priority import DEFAULT_CLASS, PRIORITY_CLASSES

LEASE_MS = 20_000
RENEW_EVERY = 5.0
W_IN, W_OUT = 1, 2  # weighted service = prompt + 2 x completion tokens
ROUTE_SLACK = 1  # replicas within this many requests of the least loaded count as "least"
HOLD_MS = 100  # how long a completed request's slot is kept for its tenant's next request
TICK_SECONDS = 0.05  # how often a process with waiting requests releases expired holds
IDLE_GRACE_MS = 1000  # a pause shorter than this between a tenant's requests is not idleness
# A request that does not fit yet lets others that fit go past it for this long, then
# waits for its room with nobody passing it; the next tenants looked at for one that fits.
BACKFILL_MS = 2000
BACKFILL_SCAN = 8
BANDS, DEFAULT_BAND = len(PRIORITY_CLASSES), PRIORITY_CLASSES.index(DEFAULT_CLASS)
SHARE = 10  # the starvation guard: a waiting lower band gets at least 1 admission in SHARE
# The Lua scripts' (inference/gateway/lua/admission/) numbers, from here.
_CONSTANTS = {
    "BANDS": BANDS,
    "DEFAULT_BAND": DEFAULT_BAND,
    "SHARE": SHARE,
    "HOLD": HOLD_MS,
    "IDLE_GRACE": IDLE_GRACE_MS,
    "BACKFILL": BACKFILL_MS,
    "BACKFILL_SCAN": BACKFILL_SCAN,
}


# ARGV: lease slack rid tenant weight est proc prefix wait_ms adapter seqs band
ENQUEUE = Script("admission", "enqueue", constants=_CONSTANTS)

# ARGV: lease slack rid tenant weight est proc prefix adapter seqs [probe]
#   -> {'granted', replica} | {'no', why} | {'nocatalog', ''}: room lent at once, or none;
#      with probe '1', {'room', replica} instead of a grant (nothing lent: ``lendable``)
LEND = Script("admission", "lend", constants=_CONSTANTS)

# ARGV: lease slack  ->  held slots left (expired holds are released, waiters admitted)
TICK = Script("admission", "tick", constants=_CONSTANTS)

# ARGV: lease slack rid amount
PROGRESS = Script("admission", "progress", constants=_CONSTANTS)

# ARGV: lease slack rid adjustment [nohold]
COMPLETE = Script("admission", "complete", constants=_CONSTANTS)

# ARGV: lease slack rid  ->  {'cancelled'|'granted'|'gone', replica}
CANCEL = Script("admission", "cancel", constants=_CONSTANTS)

# ARGV: lease slack rid failed_replica
#   -> another replica id; the same id (it is the only one left: retry it, the health probe
#      decides whether it is down); '' (no room anywhere: the slot is released); or '-' (the
#      request holds no slot any more: its lent room was taken back, or its lease ran out)
REROUTE = Script("admission", "reroute", constants=_CONSTANTS)

# ARGV: lease slack replica  ->  1 if it left the rotation (the pool's last one stays: the
# health probe decides; the next catalog publish brings back a replica the probe finds well)
SUSPECT = Script("admission", "suspect", constants=_CONSTANTS)

# ARGV: lease slack rid...
RENEW = Script("admission", "renew", constants=_CONSTANTS)

"""Token-weighted fair admission (Virtual Token Counter) over Redis, global across processes.

Per pool, under one hash tag (``ip:{p:<pool>}:``):
  counters      hash   tenant -> virtual token counter (weighted service received)
  active        hash   tenant -> requests running (or holding a slot)
  idle_since    hash   tenant -> when it last had nothing running
  holds         zset   "tenant|replica|rid" -> expiry: slots kept for a returning tenant
  backlog       zset   backlogged tenants, scored by counter
  q:<tenant>    list   that tenant's waiting request ids (``fcfs``: one list for all)
  req:<rid>     hash   tenant, weight, estimate, sequences, process, prefix, deadline, state,
                       replica
  inflight      zset   admitted request ids by lease expiry (renewed while they run)
  replicas      hash   ready replica id -> capacity (``catalog_publish`` writes it)
  rload         hash   replica id -> sequences in flight (a request runs prompts x n of them)
  grants:<proc> list   admitted request ids for the web process that holds the connection

Capacity counts sequences, not requests: a request of 8 prompts with n=2 takes 16 of a
replica's ``max_inflight`` slots (one larger than a replica is refused before it gets here),
so no request shape can put more work on an engine than its share.

Admitting picks the backlogged tenant with the smallest counter, charges it
``w_in·prompt_estimate / weight`` and routes the request (least loaded replica; among
near-least-loaded ones, rendezvous hashing of the prompt's prefix for cache affinity; for a
LoRA adapter, the least loaded replica already holding it, see ``inference.api.lora``).
Output tokens are charged as they stream (PROGRESS); COMPLETE reconciles the estimate with
the engine's count, frees the slot and admits the next request. A tenant that becomes
backlogged after being idle (nothing queued, nothing running) has its counter lifted to the
smallest backlogged counter, so idle time earns no credit. When a request ends and its
tenant is owed service but has nothing queued yet (a client about to send its next request),
the slot is held for that tenant for HOLD_MS before anyone else gets it. Leases of a crashed
process expire and are reaped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections import Counter
from dataclasses import dataclass, field

from redis.asyncio.client import Pipeline
from redis.exceptions import RedisError

from inference.api.errors import overloaded
from inference.api.lua import run_into, script
from inference.api.redis import redis_async
from inference.catalog import pool_prefix

log = logging.getLogger(__name__)

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

_PRELUDE = """
local base = KEYS[1]
local tm = redis.call('TIME')
local now = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000)
local LEASE = tonumber(ARGV[1])
local SLACK = tonumber(ARGV[2])
local HOLD = __HOLD_MS__
local IDLE_GRACE = __IDLE_GRACE_MS__
local BACKFILL = __BACKFILL_MS__
local BACKFILL_SCAN = __BACKFILL_SCAN__

local function unload(rep, seqs)
  local n = tonumber(seqs) or 1
  if rep and n > 0 and redis.call('HINCRBY', base .. 'rload', rep, 0 - n) < 0 then
    redis.call('HSET', base .. 'rload', rep, 0)
  end
end

local function deactivate(tenant)
  if tenant and redis.call('HINCRBY', base .. 'active', tenant, -1) <= 0 then
    redis.call('HDEL', base .. 'active', tenant)
    redis.call('HSET', base .. 'idle_since', tenant, now)
  end
end

local function reap()
  local expired = redis.call('ZRANGEBYSCORE', base .. 'inflight', '-inf', now)
  for _, rid in ipairs(expired) do
    local r = redis.call('HMGET', base .. 'req:' .. rid, 'replica', 'tenant', 'seqs')
    unload(r[1], r[3])
    deactivate(r[2])
    redis.call('ZREM', base .. 'inflight', rid)
    redis.call('DEL', base .. 'req:' .. rid)
  end
  -- Slots held for a tenant that did not come back in time go to whoever waits.
  for _, h in ipairs(redis.call('ZRANGEBYSCORE', base .. 'holds', '-inf', now)) do
    local tenant, rep, _, seqs = string.match(h, '^([^|]*)|([^|]*)|([^|]*)|?(%d*)$')
    unload(rep, seqs)
    deactivate(tenant)
    redis.call('ZREM', base .. 'holds', h)
  end
end

local function pick_replica(prefix, adapter, seqs)
  seqs = tonumber(seqs) or 1
  local reps = redis.call('HGETALL', base .. 'replicas')
  if #reps == 0 then return nil end
  local ids = {}
  for i = 1, #reps, 2 do ids[#ids + 1] = reps[i] end
  local loads = redis.call('HMGET', base .. 'rload', unpack(ids))
  local open, minload = {}, nil
  for i = 1, #ids do
    local load = tonumber(loads[i] or '0')
    if load + seqs <= tonumber(reps[2 * i]) then
      open[#open + 1] = {ids[i], load}
      if minload == nil or load < minload then minload = load end
    end
  end
  if minload == nil then return nil end
  if adapter and adapter ~= '' then
    -- A replica that already holds the adapter (the least loaded of them) saves a load.
    local held, heldload = nil, nil
    for _, c in ipairs(open) do
      if redis.call('ZSCORE', base .. 'lora:' .. c[1], adapter)
          and (heldload == nil or c[2] < heldload) then
        held, heldload = c[1], c[2]
      end
    end
    if held then return held end
    -- None does: concurrent first requests for it agree on one replica to load it on.
    prefix = adapter
  end
  local best, bestscore = nil, nil
  for _, c in ipairs(open) do
    if c[2] <= minload + SLACK then
      local score
      if prefix ~= '' then score = redis.sha1hex(prefix .. '|' .. c[1])
      else score = string.format('%012d', 999999999999 - c[2]) end
      if bestscore == nil or score > bestscore then best, bestscore = c[1], score end
    end
  end
  return best
end

local function policy()
  return redis.call('GET', base .. 'policy') or 'vtc'
end

local function leave_backlog_if_empty(tenant)
  if redis.call('LLEN', base .. 'q:' .. tenant) == 0 then
    redis.call('ZREM', base .. 'backlog', tenant)
    redis.call('SET', base .. 'last_left', redis.call('HGET', base .. 'counters', tenant) or '0')
    return true
  end
  return false
end

-- The next live waiting request: {rid, tenant, list key}, dropping ones past their deadline.
local function next_request()
  local order = (policy() == 'fcfs') and {'fcfs', 'vtc'} or {'vtc', 'fcfs'}
  for _, kind in ipairs(order) do
    while true do
      local rid, tenant, list
      if kind == 'fcfs' then
        list = base .. 'fcfs'
        rid = redis.call('LINDEX', list, 0)
        if not rid then break end
      else
        local head = redis.call('ZRANGE', base .. 'backlog', 0, 0)
        if #head == 0 then break end
        tenant = head[1]
        list = base .. 'q:' .. tenant
        rid = redis.call('LINDEX', list, 0)
        if not rid then redis.call('ZREM', base .. 'backlog', tenant) end
      end
      if rid then
        local r = redis.call('HMGET', base .. 'req:' .. rid, 'tenant', 'deadline')
        if r[1] and tonumber(r[2]) > now then return {rid, r[1], list, kind} end
        redis.call('LPOP', list)
        redis.call('DEL', base .. 'req:' .. rid)
        if kind == 'vtc' then leave_backlog_if_empty(tenant) end
      end
    end
  end
  return nil
end

-- Admit while there is room. Grants go to the owning process's list, except self_rid's,
-- whose replica is returned (the caller is waiting on this very script).
-- A waiting request, behind the head, of one of the next backlogged tenants that fits now:
-- {rid, tenant, list, replica}, or nil.
local function backfill()
  for _, tenant in ipairs(redis.call('ZRANGE', base .. 'backlog', 1, BACKFILL_SCAN)) do
    local list = base .. 'q:' .. tenant
    local rid = redis.call('LINDEX', list, 0)
    if rid then
      local r = redis.call('HMGET', base .. 'req:' .. rid, 'prefix', 'adapter', 'seqs', 'deadline')
      if tonumber(r[4]) and tonumber(r[4]) > now then
        local rep = pick_replica(r[1], r[2], r[3])
        if rep then return {rid, tenant, list, rep} end
      end
    end
  end
  return nil
end

-- Admit while there is room. Grants go to the owning process's list, except self_rid's,
-- whose replica is returned (the caller is waiting on this very script).
local function dispatch(self_rid)
  local mine = nil
  while true do
    local n = next_request()
    if not n then break end
    local rid, tenant, list, kind = n[1], n[2], n[3], n[4]
    local head = redis.call('HMGET', base .. 'req:' .. rid, 'prefix', 'adapter', 'seqs', 'since')
    local rep = pick_replica(head[1], head[2], head[3])
    if not rep then
      -- The head wants more room than any replica has free. For a moment (BACKFILL) the
      -- next tenants' requests that fit may go past it; after that nobody does, so the
      -- room it needs frees up: a large request is never starved by smaller ones, and
      -- smaller ones are not stopped at once by a large one.
      if kind ~= 'vtc' or now - (tonumber(head[4]) or 0) >= BACKFILL then break end
      local b = backfill()
      if not b then break end
      rid, tenant, list, rep = b[1], b[2], b[3], b[4]
    end
    local key = base .. 'req:' .. rid
    local r = redis.call('HMGET', key, 'weight', 'est', 'proc', 'seqs')
    redis.call('LPOP', list)
    local cost = tonumber(r[2]) / tonumber(r[1])
    local c = redis.call('HINCRBYFLOAT', base .. 'counters', tenant, cost)
    if kind == 'vtc' and not leave_backlog_if_empty(tenant) then
      redis.call('ZADD', base .. 'backlog', c, tenant)
    end
    redis.call('HINCRBY', base .. 'rload', rep, tonumber(r[4]) or 1)
    redis.call('HINCRBY', base .. 'active', tenant, 1)
    redis.call('HSET', key, 'state', 'granted', 'replica', rep)
    redis.call('ZADD', base .. 'inflight', now + LEASE, rid)
    if rid == self_rid then
      mine = rep
    else
      redis.call('RPUSH', base .. 'grants:' .. r[3], rid .. '|' .. rep)
      redis.call('PEXPIRE', base .. 'grants:' .. r[3], 120000)
    end
  end
  return mine
end

-- A completing request's tenant that is owed service (its counter is at or below every
-- waiting tenant's) but has nothing queued is most likely a client about to send its next
-- request: keep the slot for it briefly instead of handing it to the heaviest tenant. Without
-- this, a tenant with a few closed-loop clients loses a slot at every completion.
local function owed_hold(tenant, rep)
  if policy() == 'fcfs' or redis.call('LLEN', base .. 'q:' .. tenant) > 0 then return false end
  if redis.call('HEXISTS', base .. 'replicas', rep) == 0 then return false end
  local low = redis.call('ZRANGE', base .. 'backlog', 0, 0, 'WITHSCORES')
  if #low == 0 then return false end
  local c = tonumber(redis.call('HGET', base .. 'counters', tenant) or '0')
  return c <= tonumber(low[2])
end

local function charge(tenant, weight, amount)
  if amount == 0 then return end
  local c = redis.call('HINCRBYFLOAT', base .. 'counters', tenant, amount / weight)
  if redis.call('ZSCORE', base .. 'backlog', tenant) then
    redis.call('ZADD', base .. 'backlog', c, tenant)
  end
end
"""
_PRELUDE = (
    _PRELUDE.replace("__HOLD_MS__", str(HOLD_MS))
    .replace("__IDLE_GRACE_MS__", str(IDLE_GRACE_MS))
    .replace("__BACKFILL_MS__", str(BACKFILL_MS))
    .replace("__BACKFILL_SCAN__", str(BACKFILL_SCAN))
)

# ARGV: lease slack rid tenant weight est proc prefix wait_ms adapter seqs
ENQUEUE = (
    _PRELUDE
    + """
reap()
if redis.call('EXISTS', base .. 'replicas') == 0 then return {'nocatalog', ''} end
local rid, tenant, weight, est = ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local seqs = tonumber(ARGV[11])
local key = base .. 'req:' .. rid
local wait = tonumber(ARGV[9])
redis.call('HSET', key, 'tenant', tenant, 'weight', weight, 'est', est, 'proc', ARGV[7],
  'prefix', ARGV[8], 'adapter', ARGV[10], 'seqs', seqs, 'state', 'queued',
  'deadline', now + wait, 'since', now)
redis.call('PEXPIRE', key, wait + 3600000)
-- Slots held for this tenant (see owed_hold): take them at once if the request fits in
-- them (giving back the rest); one that does not fit lets them go and queues.
for _, h in ipairs(redis.call('ZRANGEBYSCORE', base .. 'holds', now, '+inf')) do
  if string.sub(h, 1, #tenant + 1) == tenant .. '|' then
    local rep, _, held = string.match(h, '^[^|]*|([^|]*)|([^|]*)|?(%d*)$')
    held = tonumber(held) or 1
    redis.call('ZREM', base .. 'holds', h)
    if seqs <= held then
      redis.call('HINCRBYFLOAT', base .. 'counters', tenant, tonumber(est) / tonumber(weight))
      redis.call('HSET', key, 'state', 'granted', 'replica', rep)
      redis.call('ZADD', base .. 'inflight', now + LEASE, rid)
      if held > seqs then
        unload(rep, held - seqs)
        dispatch(nil)  -- the rest of the held room, to whoever waits
      end
      return {'granted', rep}
    end
    unload(rep, held)
    deactivate(tenant)
    break
  end
end
if policy() == 'fcfs' then
  redis.call('RPUSH', base .. 'fcfs', rid)
elseif redis.call('RPUSH', base .. 'q:' .. tenant, rid) == 1 then
  -- Newly backlogged. A tenant that was idle (nothing queued, nothing running for longer
  -- than IDLE_GRACE) is lifted to the smallest backlogged counter (or the last one to leave),
  -- so idle time earns no credit. One whose requests are running, or that paused only for a
  -- moment between requests, keeps its counter: it was not idle.
  local c = tonumber(redis.call('HGET', base .. 'counters', tenant) or '0')
  local since = tonumber(redis.call('HGET', base .. 'idle_since', tenant) or '0')
  if not redis.call('HGET', base .. 'active', tenant) and now - since > IDLE_GRACE then
    local low = redis.call('ZRANGE', base .. 'backlog', 0, 0, 'WITHSCORES')
    local floor = (#low > 0) and tonumber(low[2])
      or tonumber(redis.call('GET', base .. 'last_left') or '0')
    if floor > c then
      c = floor
      redis.call('HSET', base .. 'counters', tenant, tostring(c))
    end
  end
  redis.call('ZADD', base .. 'backlog', c, tenant)
end
local mine = dispatch(rid)
if mine then return {'granted', mine} end
return {'queued', ''}
"""
)

# ARGV: lease slack  ->  held slots left (expired holds are released, waiters admitted)
TICK = (
    _PRELUDE
    + """
reap()
dispatch(nil)
return redis.call('ZCARD', base .. 'holds')
"""
)

# ARGV: lease slack rid amount
PROGRESS = (
    _PRELUDE
    + """
local r = redis.call('HMGET', base .. 'req:' .. ARGV[3], 'tenant', 'weight', 'state')
if r[3] ~= 'granted' then return 0 end
charge(r[1], tonumber(r[2]), tonumber(ARGV[4]))
return 1
"""
)

# ARGV: lease slack rid adjustment
COMPLETE = (
    _PRELUDE
    + """
reap()
local key = base .. 'req:' .. ARGV[3]
local r = redis.call('HMGET', key, 'tenant', 'weight', 'state', 'replica', 'seqs')
if r[3] == 'granted' then
  charge(r[1], tonumber(r[2]), tonumber(ARGV[4]))
  redis.call('ZREM', base .. 'inflight', ARGV[3])
  redis.call('DEL', key)
  if owed_hold(r[1], r[4]) then
    redis.call('ZADD', base .. 'holds', now + HOLD,
      r[1] .. '|' .. r[4] .. '|' .. ARGV[3] .. '|' .. (r[5] or '1'))
  else
    unload(r[4], r[5])
    deactivate(r[1])
  end
end
dispatch(nil)
return 1
"""
)

# ARGV: lease slack rid  ->  {'cancelled'|'granted'|'gone', replica}
CANCEL = (
    _PRELUDE
    + """
local rid = ARGV[3]
local key = base .. 'req:' .. rid
local r = redis.call('HMGET', key, 'tenant', 'state', 'replica')
if r[2] == 'granted' then return {'granted', r[3]} end
if r[2] == 'queued' then
  redis.call('LREM', base .. 'fcfs', 1, rid)
  if redis.call('LREM', base .. 'q:' .. r[1], 1, rid) > 0 then leave_backlog_if_empty(r[1]) end
  redis.call('DEL', key)
  return {'cancelled', ''}
end
return {'gone', ''}
"""
)

# ARGV: lease slack rid failed_replica
#   -> another replica id; the same id (it is the only one left: retry it, the health probe
#      decides whether it is down); or '' (no room anywhere: the slot is released)
REROUTE = (
    _PRELUDE
    + """
local rid, failed = ARGV[3], ARGV[4]
local key = base .. 'req:' .. rid
local r = redis.call('HMGET', key, 'state', 'prefix', 'tenant', 'adapter', 'seqs')
if r[1] ~= 'granted' then return '' end
local listed = redis.call('HEXISTS', base .. 'replicas', failed) == 1
if listed and redis.call('HLEN', base .. 'replicas') == 1 then return failed end
redis.call('HDEL', base .. 'replicas', failed)
if redis.call('HLEN', base .. 'replicas') == 0 then
  redis.call('HSET', base .. 'replicas', 'none', 0)
end
unload(failed, r[5])
local rep = pick_replica(r[2], r[4], r[5])
if rep then
  redis.call('HINCRBY', base .. 'rload', rep, tonumber(r[5]) or 1)
  redis.call('HSET', key, 'replica', rep)
  return rep
end
deactivate(r[3])
redis.call('ZREM', base .. 'inflight', rid)
redis.call('DEL', key)
dispatch(nil)
return ''
"""
)

# ARGV: lease slack replica  ->  1 if it left the rotation (the pool's last one stays: the
# health probe decides; the next catalog publish brings back a replica the probe finds well)
SUSPECT = (
    _PRELUDE
    + """
if redis.call('HEXISTS', base .. 'replicas', ARGV[3]) == 0 then return 0 end
if redis.call('HLEN', base .. 'replicas') <= 1 then return 0 end
redis.call('HDEL', base .. 'replicas', ARGV[3])
return 1
"""
)

# ARGV: lease slack rid...
RENEW = (
    _PRELUDE
    + """
for i = 3, #ARGV do
  redis.call('ZADD', base .. 'inflight', 'XX', now + LEASE, ARGV[i])
  redis.call('PEXPIRE', base .. 'req:' .. ARGV[i], 3600000)
end
return 1
"""
)


class CatalogMissing(Exception):
    """Redis has no capacity record for the pool (it was flushed): publish and retry."""


@dataclass
class Admission:
    """This process's side of admission: waits for grants, renews leases."""

    proc: str = field(default_factory=lambda: uuid.uuid4().hex)
    waiters: dict[str, asyncio.Future[str]] = field(default_factory=dict)
    # rid -> (pool, the limits' in-flight leases it holds, its name in them)
    held: dict[str, tuple[str, tuple[str, ...], str]] = field(default_factory=dict)
    claimed: set[str] = field(default_factory=set)
    waiting: Counter[str] = field(default_factory=Counter)
    listeners: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    renewer: asyncio.Task[None] | None = None

    def _args(self, *args: str | int | float) -> list[str | int | float]:
        return [LEASE_MS, ROUTE_SLACK, *args]

    async def admit(
        self,
        *,
        pool: str,
        rid: str,
        tenant: int,
        weight: int,
        prompt_estimate: int,
        prefix: str,
        wait_seconds: float,
        limit_keys: tuple[str, ...],
        limit_member: str = "",
        adapter: str = "",
        sequences: int = 1,
    ) -> str:
        """Wait for a slot; the replica id to send the request to. 503 after the wait."""
        self._start(pool)
        base = pool_prefix(pool)
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.waiters[rid] = future
        self.waiting[pool] += 1
        # The limits' leases are renewed from now on, while the request waits too (a wait
        # may outlast a lease).
        self.held[rid] = (pool, limit_keys, limit_member or rid)
        granted = False
        try:
            result = await script(ENQUEUE)(
                keys=[base],
                args=self._args(
                    rid,
                    tenant,
                    weight,
                    W_IN * prompt_estimate,
                    self.proc,
                    prefix,
                    int(wait_seconds * 1000),
                    adapter,
                    sequences,
                ),
            )
            state, replica = result[0].decode(), result[1].decode()
            if state == "nocatalog":
                raise CatalogMissing(pool)
            if state == "granted":
                granted = True
                return replica
            try:
                replica = await asyncio.wait_for(asyncio.shield(future), timeout=wait_seconds)
            except (TimeoutError, asyncio.CancelledError) as exc:
                replica = await self._withdraw(pool, rid, future)
                if isinstance(exc, asyncio.CancelledError):
                    if replica:
                        await self.complete(pool=pool, rid=rid, adjustment=0)
                    raise
                if not replica:
                    raise overloaded(max(1, int(wait_seconds / 4))) from None
            granted = True
            return replica
        finally:
            if not granted:
                self.held.pop(rid, None)
            self.waiters.pop(rid, None)
            self.waiting[pool] -= 1

    async def _withdraw(self, pool: str, rid: str, future: asyncio.Future[str]) -> str:
        """Leave the queue; if the grant won the race, the replica it carries."""
        result = await script(CANCEL)(keys=[pool_prefix(pool)], args=self._args(rid))
        if result[0].decode() != "granted":
            return ""
        # The grant is on its way to our listener; take it here and tell the listener.
        self.claimed.add(rid)
        if future.done():
            self.claimed.discard(rid)
        return result[1].decode()

    async def progress(self, *, pool: str, rid: str, completion_tokens: int) -> None:
        await script(PROGRESS)(
            keys=[pool_prefix(pool)], args=self._args(rid, W_OUT * completion_tokens)
        )

    async def complete(self, *, pool: str, rid: str, adjustment: float) -> None:
        """Free the slot; ``adjustment`` is the weighted service not yet charged."""
        self.held.pop(rid, None)
        await script(COMPLETE)(keys=[pool_prefix(pool)], args=self._args(rid, adjustment))

    def complete_into(self, pipe: Pipeline, *, pool: str, rid: str, adjustment: float) -> None:
        self.held.pop(rid, None)
        run_into(pipe, COMPLETE, [pool_prefix(pool)], self._args(rid, adjustment))

    async def reroute(self, *, pool: str, rid: str, failed: str) -> str:
        """The replica failed before answering: take it out of rotation, try another."""
        result = await script(REROUTE)(keys=[pool_prefix(pool)], args=self._args(rid, failed))
        replica = result.decode() if isinstance(result, bytes) else str(result)
        if not replica:
            self.held.pop(rid, None)
        return replica

    async def suspect(self, *, pool: str, replica: str) -> bool:
        """A replica went silent mid-stream: no new requests go there until a probe (whose
        catalog publish restores the ready set) finds it answering again."""
        left = await script(SUSPECT)(keys=[pool_prefix(pool)], args=self._args(replica))
        return bool(left)

    # --- background tasks --------------------------------------------------------------

    def _start(self, pool: str) -> None:
        if pool not in self.listeners or self.listeners[pool].done():
            self.listeners[pool] = asyncio.create_task(self._listen(pool))
        if self.renewer is None or self.renewer.done():
            self.renewer = asyncio.create_task(self._renew())

    async def _listen(self, pool: str) -> None:
        base = pool_prefix(pool)
        key = base + "grants:" + self.proc
        while True:
            waiting = self.waiting[pool] > 0
            try:
                item = await redis_async().blpop([key], timeout=TICK_SECONDS if waiting else 1)
                if item is None and waiting:
                    # Nothing came: release held slots whose tenant did not return.
                    await script(TICK)(keys=[base], args=self._args())
            except RedisError:
                log.warning("admission listener for %s lost Redis; retrying", pool)
                await asyncio.sleep(0.5)
                continue
            if item is None:
                continue
            grant = item[1]
            text = grant.decode() if isinstance(grant, bytes) else str(grant)
            rid, _, replica = text.partition("|")
            future = self.waiters.get(rid)
            if rid in self.claimed:
                self.claimed.discard(rid)
            elif future is not None and not future.done():
                future.set_result(replica)
            else:  # nobody waits any more (left, timed out): give the slot back at once
                with contextlib.suppress(RedisError):
                    await self.complete(pool=pool, rid=rid, adjustment=0)

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(RENEW_EVERY)
            if not self.held:
                continue
            by_pool: dict[str, list[str]] = {}
            limit_keys: dict[str, list[str]] = {}
            for rid, (pool, keys, member) in list(self.held.items()):
                by_pool.setdefault(pool, []).append(rid)
                for k in keys:
                    limit_keys.setdefault(k, []).append(member)
            try:
                for pool, rids in by_pool.items():
                    await script(RENEW)(keys=[pool_prefix(pool)], args=self._args(*rids))
                client = redis_async()
                pipe = client.pipeline(transaction=False)
                expiry = await client.time()
                until = expiry[0] * 1000 + expiry[1] // 1000 + LEASE_MS
                for k, members in limit_keys.items():
                    pipe.zadd(k, dict.fromkeys(members, until), xx=True)
                    pipe.pexpire(k, 2 * LEASE_MS)  # the set outlives its longest lease
                await pipe.execute()
            except RedisError:
                log.warning("could not renew admission leases", exc_info=True)


_admissions: dict[asyncio.AbstractEventLoop, Admission] = {}


def admission() -> Admission:
    loop = asyncio.get_running_loop()
    found = _admissions.get(loop)
    if found is None:
        found = _admissions[loop] = Admission()
    return found

-- What every admission script shares: the pool's keys, lease arguments and the VTC helpers.
local base = KEYS[1]
local LEASE = tonumber(ARGV[1])
local SLACK = tonumber(ARGV[2])

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

-- Lent room (a batch line on an online pool's idle capacity, lend.lua): ``lent`` zset of
-- request ids in the order they were lent (``lent_serial``), ``lent_seqs`` the sequences
-- they run.
local function unlend(rid, seqs)
  if redis.call('ZREM', base .. 'lent', rid) == 1
      and redis.call('DECRBY', base .. 'lent_seqs', tonumber(seqs) or 1) <= 0 then
    redis.call('DEL', base .. 'lent_seqs')
  end
end

local function reap()
  local expired = redis.call('ZRANGEBYSCORE', base .. 'inflight', '-inf', now)
  for _, rid in ipairs(expired) do
    local r = redis.call('HMGET', base .. 'req:' .. rid, 'replica', 'tenant', 'seqs')
    unload(r[1], r[3])
    unlend(rid, r[3])
    deactivate(r[2])
    redis.call('ZREM', base .. 'inflight', rid)
    redis.call('DEL', base .. 'req:' .. rid)
  end
  -- Slots held for a tenant that did not come back in time go to whoever waits; the live
  -- ones are returned (ENQUEUE looks for its tenant's among them).
  local holds = redis.call('ZRANGE', base .. 'holds', 0, -1, 'WITHSCORES')
  local live = {}
  for i = 1, #holds, 2 do
    local h = holds[i]
    if tonumber(holds[i + 1]) <= now then
      local tenant, rep, _, seqs = string.match(h, '^([^|]*)|([^|]*)|([^|]*)|?(%d*)$')
      unload(rep, seqs)
      deactivate(tenant)
      redis.call('ZREM', base .. 'holds', h)
    else
      live[#live + 1] = h
    end
  end
  return live
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

-- The pool's policy, read once per script run (it changes only with a catalog publish).
local pool_policy = nil
local function policy()
  if pool_policy == nil then pool_policy = redis.call('GET', base .. 'policy') or 'vtc' end
  return pool_policy
end

-- Priority bands (0 runs first, BANDS - 1 last): each has its own queues, backlog and
-- counters, so fairness (VTC) holds inside a band and never between bands.
local function band_of(b)
  b = tonumber(b) or DEFAULT_BAND
  if b < 0 or b >= BANDS then return DEFAULT_BAND end
  return math.floor(b)
end
local function qkey(band, tenant) return base .. 'q:' .. band .. ':' .. tenant end
local function backlog_key(band) return base .. 'backlog:' .. band end
local function counters_key(band) return base .. 'counters:' .. band end
local function fcfs_key(band) return base .. 'fcfs:' .. band end

-- Whether anything waits in the band (an empty zset or list is no key at all).
local function band_waits(band)
  return redis.call('EXISTS', backlog_key(band), fcfs_key(band)) > 0
end

-- (``counter``: the tenant's counter in the band, when the caller has it already.)
local function leave_backlog_if_empty(band, tenant, counter)
  if redis.call('LLEN', qkey(band, tenant)) == 0 then
    redis.call('ZREM', backlog_key(band), tenant)
    redis.call('SET', base .. 'last_left:' .. band,
      counter or redis.call('HGET', counters_key(band), tenant) or '0')
    return true
  end
  return false
end

-- The next live waiting request of one band: {rid, tenant, list key, kind, band}, dropping
-- ones past their deadline.
local function next_in_band(band)
  local order = (policy() == 'fcfs') and {'fcfs', 'vtc'} or {'vtc', 'fcfs'}
  for _, kind in ipairs(order) do
    while true do
      local rid, tenant, list
      if kind == 'fcfs' then
        list = fcfs_key(band)
        rid = redis.call('LINDEX', list, 0)
        if not rid then break end
      else
        local head = redis.call('ZRANGE', backlog_key(band), 0, 0)
        if #head == 0 then break end
        tenant = head[1]
        list = qkey(band, tenant)
        rid = redis.call('LINDEX', list, 0)
        if not rid then redis.call('ZREM', backlog_key(band), tenant) end
      end
      if rid then
        local r = redis.call('HMGET', base .. 'req:' .. rid, 'tenant', 'deadline')
        if r[1] and tonumber(r[2]) > now then return {rid, r[1], list, kind, band} end
        redis.call('LPOP', list)
        redis.call('DEL', base .. 'req:' .. rid)
        if kind == 'vtc' then leave_backlog_if_empty(band, tenant) end
      end
    end
  end
  return nil
end

-- The next request to admit: the highest band's, except that a lower band passed over
-- SHARE - 1 times in a row while it waited goes next (the starvation guard: under a flood
-- at the top, every lower band still gets at least one admission in SHARE).
local LOWER_BANDS = {}
for band = 1, BANDS - 1 do LOWER_BANDS[#LOWER_BANDS + 1] = band end

-- Every band's waiting lists: one EXISTS says whether anything waits at all (the common case
-- at a request's end: nothing, and no band is looked at). With nothing waiting, no band is
-- being passed over any more: the starvation guard's counts start again (``passed``).
local WAIT_KEYS = {}
for band = 0, BANDS - 1 do
  WAIT_KEYS[#WAIT_KEYS + 1] = backlog_key(band)
  WAIT_KEYS[#WAIT_KEYS + 1] = fcfs_key(band)
end

local function next_request()
  if redis.call('EXISTS', unpack(WAIT_KEYS)) == 0 then
    redis.call('DEL', base .. 'passed')
    return nil
  end
  local passed = redis.call('HMGET', base .. 'passed', unpack(LOWER_BANDS))
  for i, band in ipairs(LOWER_BANDS) do
    if tonumber(passed[i] or '0') >= SHARE - 1 then
      local n = next_in_band(band)
      if n then return n end
      redis.call('HDEL', base .. 'passed', band)
    end
  end
  for band = 0, BANDS - 1 do
    local n = next_in_band(band)
    if n then return n end
  end
  return nil
end

-- A grant in ``band``: the lower bands that waited meanwhile were passed over once more.
local function passed_over(band)
  redis.call('HDEL', base .. 'passed', band)
  for lower = band + 1, BANDS - 1 do
    if band_waits(lower) then redis.call('HINCRBY', base .. 'passed', lower, 1) end
  end
end

-- A waiting request, behind the head, of one of the next backlogged tenants of the band that
-- fits now: {rid, tenant, list, replica}, or nil.
local function backfill(band)
  for _, tenant in ipairs(redis.call('ZRANGE', backlog_key(band), 1, BACKFILL_SCAN)) do
    local list = qkey(band, tenant)
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

-- Revoke a lent request: its slot is free from now on, and its process is told to abort it on
-- the engine ('!' .. rid on its grants list; the batch line goes back to pending).
local function revoke(rid)
  local key = base .. 'req:' .. rid
  local r = redis.call('HMGET', key, 'replica', 'tenant', 'seqs', 'proc')
  unlend(rid, r[3])
  unload(r[1], r[3])
  deactivate(r[2])
  redis.call('ZREM', base .. 'inflight', rid)
  redis.call('DEL', key)
  if r[4] then
    redis.call('RPUSH', base .. 'grants:' .. r[4], '!' .. rid)
    redis.call('PEXPIRE', base .. 'grants:' .. r[4], 120000)
  end
  redis.call('HINCRBY', base .. 'lending', 'reclaimed', 1)
end

-- Online demand takes lent room back at once, for a waiting request of ``seqs`` sequences
-- that finds none: the newest lent request whose replica then has room for it; else the
-- newest on a replica where all its lent room together would make enough (the next call
-- takes the rest). None when even that would not do: nothing is aborted for nothing.
-- Returns whether one was revoked.
local function reclaim(seqs)
  local lent = redis.call('ZREVRANGE', base .. 'lent', 0, -1)
  if #lent == 0 then return false end
  seqs = tonumber(seqs) or 1
  local reps = redis.call('HGETALL', base .. 'replicas')
  local cap, ids = {}, {}
  for i = 1, #reps, 2 do
    cap[reps[i]] = tonumber(reps[i + 1])
    ids[#ids + 1] = reps[i]
  end
  local load = {}
  local loads = redis.call('HMGET', base .. 'rload', unpack(ids))
  for i, id in ipairs(ids) do load[id] = tonumber(loads[i] or '0') end
  local lent_on, newest_on = {}, {}
  for _, rid in ipairs(lent) do
    local r = redis.call('HMGET', base .. 'req:' .. rid, 'replica', 'seqs')
    local rep, n = r[1], tonumber(r[2]) or 1
    if rep and cap[rep] then
      if load[rep] - n + seqs <= cap[rep] then
        revoke(rid)
        return true
      end
      lent_on[rep] = (lent_on[rep] or 0) + n
      newest_on[rep] = newest_on[rep] or rid
    end
  end
  for rep, n in pairs(lent_on) do
    if load[rep] - n + seqs <= cap[rep] then
      revoke(newest_on[rep])
      return true
    end
  end
  return false
end

-- Admit while there is room. Grants go to the owning process's list, except self_rid's,
-- whose replica is returned (the caller is waiting on this very script).
local function dispatch(self_rid)
  local mine = nil
  while true do
    local n = next_request()
    if not n then break end
    local rid, tenant, list, kind, band = n[1], n[2], n[3], n[4], n[5]
    local head = redis.call('HMGET', base .. 'req:' .. rid, 'prefix', 'adapter', 'seqs', 'since',
      'weight', 'est', 'proc')
    local rep = pick_replica(head[1], head[2], head[3])
    -- Lent room is the waiting request's before anything else (backfill included).
    while not rep and reclaim(head[3]) do rep = pick_replica(head[1], head[2], head[3]) end
    if not rep then
      -- The head wants more room than any replica has free. For a moment (BACKFILL) the
      -- next tenants' requests that fit may go past it; after that nobody does, so the
      -- room it needs frees up: a large request is never starved by smaller ones, and
      -- smaller ones are not stopped at once by a large one.
      if kind ~= 'vtc' or now - (tonumber(head[4]) or 0) >= BACKFILL then break end
      local b = backfill(band)
      if not b then break end
      rid, tenant, list, rep = b[1], b[2], b[3], b[4]
    end
    local key = base .. 'req:' .. rid
    local r = {head[5], head[6], head[7], head[3]}  -- weight est proc seqs
    if rid ~= n[1] then r = redis.call('HMGET', key, 'weight', 'est', 'proc', 'seqs') end  -- backfilled
    redis.call('LPOP', list)
    local cost = tonumber(r[2]) / tonumber(r[1])
    local c = redis.call('HINCRBYFLOAT', counters_key(band), tenant, cost)
    if kind == 'vtc' and not leave_backlog_if_empty(band, tenant, c) then
      redis.call('ZADD', backlog_key(band), c, tenant)
    end
    passed_over(band)
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

-- A completing request's tenant that is owed service in its band (its counter is at or
-- below every waiting tenant's there) but has nothing queued is most likely a client about
-- to send its next request: keep the slot for it briefly instead of handing it to the
-- heaviest tenant. Without this, a tenant with a few closed-loop clients loses a slot at
-- every completion. Never while a higher band waits: its requests go first.
local function owed_hold(tenant, rep, band)
  -- Nobody backlogged in the band (the usual case under light load) decides it at once.
  local low = redis.call('ZRANGE', backlog_key(band), 0, 0, 'WITHSCORES')
  if #low == 0 then return false end
  if policy() == 'fcfs' or redis.call('LLEN', qkey(band, tenant)) > 0 then return false end
  if redis.call('HEXISTS', base .. 'replicas', rep) == 0 then return false end
  for higher = 0, band - 1 do
    if band_waits(higher) then return false end
  end
  local c = tonumber(redis.call('HGET', counters_key(band), tenant) or '0')
  return c <= tonumber(low[2])
end

local function charge(tenant, band, weight, amount)
  if amount == 0 then return end
  local c = redis.call('HINCRBYFLOAT', counters_key(band), tenant, amount / weight)
  if redis.call('ZSCORE', backlog_key(band), tenant) then
    redis.call('ZADD', backlog_key(band), c, tenant)
  end
end

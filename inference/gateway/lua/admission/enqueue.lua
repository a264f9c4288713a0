local live_holds = reap()
if redis.call('EXISTS', base .. 'replicas') == 0 then return {'nocatalog', ''} end
local rid, tenant, weight, est = ARGV[3], ARGV[4], ARGV[5], ARGV[6]
local seqs = tonumber(ARGV[11])
local band = band_of(ARGV[12])
local key = base .. 'req:' .. rid
local wait = tonumber(ARGV[9])
redis.call('HSET', key, 'tenant', tenant, 'weight', weight, 'est', est, 'proc', ARGV[7],
  'prefix', ARGV[8], 'adapter', ARGV[10], 'seqs', seqs, 'state', 'queued',
  'deadline', now + wait, 'since', now, 'band', band)
redis.call('PEXPIRE', key, wait + 3600000)
-- Slots held for this tenant (see owed_hold): take them at once if the request fits in
-- them (giving back the rest); one that does not fit, or that a higher band's waiting
-- request would go before, lets them go and queues.
for _, h in ipairs(live_holds) do
  if string.sub(h, 1, #tenant + 1) == tenant .. '|' then
    local rep, _, held = string.match(h, '^[^|]*|([^|]*)|([^|]*)|?(%d*)$')
    held = tonumber(held) or 1
    redis.call('ZREM', base .. 'holds', h)
    local higher_waits = false
    for higher = 0, band - 1 do
      if band_waits(higher) then higher_waits = true end
    end
    if seqs <= held and not higher_waits then
      redis.call('HINCRBYFLOAT', counters_key(band), tenant, tonumber(est) / tonumber(weight))
      passed_over(band)
      redis.call('HSET', key, 'state', 'granted', 'replica', rep)
      redis.call('ZADD', base .. 'inflight', now + LEASE, rid)
      if held > seqs then
        unload(rep, held - seqs)
        dispatch(nil)  -- the rest of the held room, to whoever waits
      end
      return {'granted', rep}
    end
    unload(rep, held)
    deactivate(tenant)  -- the room it let go goes to whoever is first below
    break
  end
end
if policy() == 'fcfs' then
  redis.call('RPUSH', fcfs_key(band), rid)
elseif redis.call('RPUSH', qkey(band, tenant), rid) == 1 then
  -- Newly backlogged in its band. A tenant that was idle (nothing queued, nothing running for
  -- longer than IDLE_GRACE) is lifted to the band's smallest backlogged counter (or the last
  -- one to leave), so idle time earns no credit. One whose requests are running, or that
  -- paused only for a moment between requests, keeps its counter: it was not idle.
  local c = tonumber(redis.call('HGET', counters_key(band), tenant) or '0')
  local since = tonumber(redis.call('HGET', base .. 'idle_since', tenant) or '0')
  if not redis.call('HGET', base .. 'active', tenant) and now - since > IDLE_GRACE then
    local low = redis.call('ZRANGE', backlog_key(band), 0, 0, 'WITHSCORES')
    local floor = (#low > 0) and tonumber(low[2])
      or tonumber(redis.call('GET', base .. 'last_left:' .. band) or '0')
    if floor > c then
      c = floor
      redis.call('HSET', counters_key(band), tenant, tostring(c))
    end
  end
  redis.call('ZADD', backlog_key(band), c, tenant)
end
local mine = dispatch(rid)
if mine then return {'granted', mine} end
return {'queued', ''}

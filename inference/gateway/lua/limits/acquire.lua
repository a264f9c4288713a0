local rid, est, lease = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local L = {}
for i = 5, 14 do L[i - 4] = tonumber(ARGV[i]) end
local member, seqs, est_cost = ARGV[15], tonumber(ARGV[16]), tonumber(ARGV[17])
local function inflight(key)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now)
  local s, t, c = 0, 0, 0
  for _, m in ipairs(redis.call('ZRANGE', key, 0, -1)) do
    local a, b, d = string.match(m, '^[^|]*|(%d+)|(%d+)|(%d+)$')
    s = s + (tonumber(a) or 1)
    t = t + (tonumber(b) or 0)
    c = c + (tonumber(d) or 0)
  end
  return s, t, c
end
-- {in-flight key, conc limit, month key, month limit, spend key, spend limit, seed codes}
local scopes = {{7, 7, 8, 8, 11, 10, 'seed_k', 'seed_ks'}, {3, 3, 4, 4, 10, 9, 'seed_t', 'seed_ts'}}
local tracked = {}
for _, sc in ipairs(scopes) do
  local conc, month, spend = L[sc[2]], L[sc[4]], L[sc[6]]
  if conc > 0 or month > 0 or spend > 0 then
    tracked[#tracked + 1] = KEYS[sc[1]]
    local s, t, c = inflight(KEYS[sc[1]])
    -- (the limit in the retry slot: nothing to wait for)
    if conc > 0 and seqs > conc then return {0, 'conc_too_large', conc, 0, 0, 0, 0, 0, 0} end
    if conc > 0 and s + seqs > conc then return {0, 'concurrency', 1000, 0, 0, 0, 0, 0, 0} end
    for _, b in ipairs({{sc[3], month, sc[7], 'budget', t}, {sc[5], spend, sc[8], 'spend', c}}) do
      if b[2] > 0 then
        local used = redis.call('GET', KEYS[b[1]])
        if not used then return {2, b[3], 0, 0, 0, 0, 0, 0, 0} end
        if tonumber(used) + b[5] >= b[2] then return {0, b[4], 0, 0, 0, 0, 0, 0, 0} end
      end
    end
  end
end
-- {key index, limit index, tokens needed, kind}
local buckets = {{1, 1, 1, 'r'}, {5, 5, 1, 'r'}, {2, 2, est, 't'}, {6, 6, est, 't'}}
local levels, retry, reason = {}, 0, nil
for i, b in ipairs(buckets) do
  local limit = L[b[2]]
  if limit > 0 then
    local lvl = level(KEYS[b[1]], limit)
    levels[i] = lvl
    if b[3] > limit then
      return {0, 'too_large', 0, 0, 0, 0, limit, math.floor(lvl), 0}
    end
    if lvl < b[3] then
      local wait = math.ceil((b[3] - lvl) * 60000 / limit)
      if wait > retry then retry = wait; reason = (b[4] == 'r') and 'requests' or 'tokens' end
    end
  end
end
local report = {0, 0, 0, 0, 0, 0}
local taken = (reason == nil)
for i, b in ipairs(buckets) do
  local limit = L[b[2]]
  if limit > 0 then
    local left = levels[i]
    if taken then left = left - b[3]; store(KEYS[b[1]], left, limit) end
    local slot = (b[4] == 'r') and 1 or 4
    if report[slot] == 0 or left < report[slot + 1] then
      report[slot] = limit
      report[slot + 1] = math.max(0, math.floor(left))
      report[slot + 2] = math.ceil(math.max(0, limit - left) * 60000 / limit)
    end
  end
end
if not taken then
  return {0, reason, retry, report[1], report[2], report[3], report[4], report[5], report[6]}
end
for _, key in ipairs(tracked) do
  redis.call('ZADD', key, now + lease, member)
  redis.call('PEXPIRE', key, lease * 2)
end
-- The key's last use, in its tenant's hash (the request's end names the tenant to the
-- flush: a set in a slot of its own, ``tenants.keys``).
redis.call('HSET', KEYS[9], ARGV[4], math.floor(now / 1000))
return {1, 'ok', 0, report[1], report[2], report[3], report[4], report[5], report[6]}

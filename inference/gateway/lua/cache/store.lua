-- ARGV: hash answer ttl_ms max_entries max_bytes [partition vector]  ->  entries evicted to
-- make room (-1: the answer alone is larger than the tenant's bytes: not kept)
local hash, answer = ARGV[1], ARGV[2]
local ttl, max_entries, max_bytes = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local fp, vector = ARGV[6], ARGV[7]
local size = #answer + (vector and #vector or 0)
if size > max_bytes then
  return -1
end
local evicted = 0
-- Answers stored longer ago than the TTL, and the oldest whose key Redis has expired (they
-- were stored under a shorter TTL), leave the bookkeeping.
for _, old in ipairs(redis.call('ZRANGEBYSCORE', at, '-inf', now - ttl, 'LIMIT', 0, 100)) do
  forget(old)
end
for _, old in ipairs(redis.call('ZRANGE', at, 0, 19)) do
  if redis.call('EXISTS', p .. 'e:' .. old) == 0 then
    forget(old)
  end
end
if redis.call('ZSCORE', idx, hash) then
  forget(hash)
end
-- The least recently used make room, within the tenant's entries and bytes.
while redis.call('ZCARD', idx) >= max_entries
    or tonumber(redis.call('GET', total) or '0') + size > max_bytes do
  local lru = redis.call('ZRANGE', idx, 0, 0)
  if #lru == 0 then
    break
  end
  forget(lru[1])
  evicted = evicted + 1
end
redis.call('SET', p .. 'e:' .. hash, answer, 'PX', ttl)
redis.call('ZADD', idx, fresh(), hash)
redis.call('ZADD', at, now, hash)
redis.call('HSET', sizes, hash, size)
redis.call('INCRBY', total, size)
local books = { idx, at, sizes, total }
if fp and vector then
  local vecs, log, off = p .. 's:' .. fp, p .. 'sl:' .. fp, p .. 'so:' .. fp
  redis.call('HSET', vecs, hash, vector)
  -- A partition's log starts at the clock (in microseconds): a copy of an earlier one, gone
  -- with its TTL, is behind it and fetches the new one whole.
  redis.call('SET', off, now * 1000, 'NX')
  redis.call('RPUSH', log, '+' .. hash)
  -- A log much longer than the partition is dropped: copies behind it fetch it whole.
  local logged = redis.call('LLEN', log)
  if logged > 1000 + 2 * redis.call('HLEN', vecs) then
    redis.call('INCRBY', off, logged)
    redis.call('DEL', log)
  end
  redis.call('HSET', part, hash, fp)
  redis.call('SADD', parts, fp)
  for _, key in ipairs({ vecs, log, off, part, parts }) do
    books[#books + 1] = key
  end
end
-- The bookkeeping outlives every answer it counts (never shortened by a lower TTL), so a
-- purge finds them all.
for _, key in ipairs(books) do
  if redis.call('PTTL', key) < ttl then
    redis.call('PEXPIRE', key, ttl)
  end
end
return evicted

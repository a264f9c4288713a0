-- ARGV: hash answer ttl_ms max_entries max_bytes  ->  entries evicted to make room
local hash, answer = ARGV[1], ARGV[2]
local ttl, max_entries, max_bytes = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local size = #answer
local evicted = 0
-- Entries unused for a whole TTL have expired: their bookkeeping goes too.
for _, old in ipairs(redis.call('ZRANGEBYSCORE', idx, '-inf', now - ttl, 'LIMIT', 0, 100)) do
  forget(old)
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
redis.call('HSET', sizes, hash, size)
redis.call('INCRBY', total, size)
-- The bookkeeping outlives the last entry by no more than its TTL.
for _, key in ipairs({ idx, sizes, total }) do
  redis.call('PEXPIRE', key, ttl)
end
return evicted

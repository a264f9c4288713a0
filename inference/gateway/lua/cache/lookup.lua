-- ARGV: hash ttl_ms  ->  the stored answer, or nil. A hit is used: last to be evicted. An
-- answer stored longer ago than the tenant's TTL now (it was lowered) is forgotten.
local hash, ttl = ARGV[1], tonumber(ARGV[2])
local stored = redis.call('ZSCORE', at, hash)
if not stored then
  return nil
end
local found = redis.call('GET', p .. 'e:' .. hash)
if not found or now - tonumber(stored) >= ttl then
  forget(hash)
  return nil
end
redis.call('ZADD', idx, 'XX', fresh(), hash)
return found

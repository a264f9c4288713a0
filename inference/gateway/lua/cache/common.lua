-- KEYS[1]: the tenant's prefix, ip:rc:{t:<tenant>}: (one slot). Under it:
--   e:<hash>  string  a stored answer (Redis expires it after the TTL it was stored with)
--   idx       zset    hash -> when last used (ms): least recently used first
--   at        zset    hash -> when stored (ms): served only within the tenant's TTL now
--   size      hash    hash -> the answer's bytes (its text's vector included)
--   bytes     string  the bytes of all the tenant's answers
-- and for the semantic cache:
--   s:<part>  hash    hash -> the request text's vector (float32), in its partition
--   sl:<part> list    the partition's changes, "+hash" or "-hash", for web processes' copies
--   so:<part> string  how many changes the log has dropped from its head (its offset)
--   part      hash    hash -> its partition
--   parts     set     the tenant's partitions
local p = KEYS[1]
local idx, at, sizes, total = p .. 'idx', p .. 'at', p .. 'size', p .. 'bytes'
local part, parts = p .. 'part', p .. 'parts'

local function forget(hash)
  local fp = redis.call('HGET', part, hash)
  if fp then
    local vecs, off = p .. 's:' .. fp, p .. 'so:' .. fp
    redis.call('HDEL', vecs, hash)
    -- Logged only while the partition's books live (a log key never outlives them).
    local ttl = redis.call('PTTL', off)
    if ttl > 0 then
      redis.call('RPUSH', p .. 'sl:' .. fp, '-' .. hash)
      redis.call('PEXPIRE', p .. 'sl:' .. fp, ttl)
    end
    if redis.call('HLEN', vecs) == 0 then
      redis.call('SREM', parts, fp)
    end
    redis.call('HDEL', part, hash)
  end
  redis.call('DEL', p .. 'e:' .. hash)
  redis.call('ZREM', idx, hash)
  redis.call('ZREM', at, hash)
  local size = tonumber(redis.call('HGET', sizes, hash) or '0')
  redis.call('HDEL', sizes, hash)
  if size > 0 then
    redis.call('DECRBY', total, size)
  end
end

-- When an entry was last used: the clock, or just after the last one used (two uses in one
-- millisecond keep their order: the least recently used is always the one evicted).
local function fresh()
  local top = redis.call('ZRANGE', idx, -1, -1, 'WITHSCORES')
  if #top > 0 and tonumber(top[2]) >= now then
    return tonumber(top[2]) + 1
  end
  return now
end

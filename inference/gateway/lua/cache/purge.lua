-- ARGV: none  ->  how many answers the tenant's cache held
local hashes = redis.call('ZRANGE', idx, 0, -1)
for _, hash in ipairs(hashes) do
  redis.call('DEL', p .. 'e:' .. hash)
end
-- Each partition's log jumps past where any web process's copy is: they all fetch it whole
-- (empty) next time.
for _, fp in ipairs(redis.call('SMEMBERS', parts)) do
  local log, off = p .. 'sl:' .. fp, p .. 'so:' .. fp
  if redis.call('EXISTS', off) == 1 then  -- INCRBY keeps its TTL
    redis.call('INCRBY', off, redis.call('LLEN', log) + 1)
  end
  redis.call('DEL', p .. 's:' .. fp, log)
end
redis.call('DEL', idx, at, sizes, total, part, parts)
return #hashes

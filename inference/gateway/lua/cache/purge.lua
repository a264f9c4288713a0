-- ARGV: none  ->  how many answers the tenant's cache held
local hashes = redis.call('ZRANGE', idx, 0, -1)
for _, hash in ipairs(hashes) do
  redis.call('DEL', p .. 'e:' .. hash)
end
-- A partition's counter moves on (never back to a number a web process's copy has seen).
for _, fp in ipairs(redis.call('SMEMBERS', parts)) do
  redis.call('DEL', p .. 's:' .. fp)
  redis.call('INCR', p .. 'sv:' .. fp)
end
redis.call('DEL', idx, at, sizes, total, part, parts)
return #hashes

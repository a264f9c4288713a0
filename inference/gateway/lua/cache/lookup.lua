-- ARGV: hash  ->  the stored answer, or nil. A hit is used: last to be evicted.
local found = redis.call('GET', p .. 'e:' .. ARGV[1])
if found then
  redis.call('ZADD', idx, 'XX', fresh(), ARGV[1])
end
return found

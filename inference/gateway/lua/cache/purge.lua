-- ARGV: none  ->  how many answers the tenant's cache held
local hashes = redis.call('ZRANGE', idx, 0, -1)
for _, hash in ipairs(hashes) do
  redis.call('DEL', p .. 'e:' .. hash)
end
redis.call('DEL', idx, at, sizes, total)
return #hashes

-- ARGV: none  ->  how many entries the tenant's cache held
local hashes = redis.call('ZRANGE', idx, 0, -1)
for _, hash in ipairs(hashes) do
  redis.call('DEL', p .. 'e:' .. hash)
end
redis.call('DEL', idx, sizes, total)
return #hashes

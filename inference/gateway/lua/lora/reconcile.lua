-- The engine's adapters (KEYS[1]: the replica's held set), made what the router believes
-- after a probe (inference/services/probes.py): adapters the engine lists (ARGV[2..]) are held
-- (found after a restart of ours, scored oldest); ones it no longer lists are dropped, unless
-- a gateway recorded them since the probe began (ARGV[1], in ms).
local on = {}
for i = 2, #ARGV do
  on[ARGV[i]] = true
  redis.call('ZADD', KEYS[1], 'NX', 0, ARGV[i])
end
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[1])) do
  if not on[m] then redis.call('ZREM', KEYS[1], m) end
end
return 1

local rid, failed = ARGV[3], ARGV[4]
local key = base .. 'req:' .. rid
local r = redis.call('HMGET', key, 'state', 'prefix', 'tenant', 'adapter', 'seqs')
-- '-': it holds no room here any more (lent room taken back, or its lease ran out).
if r[1] ~= 'granted' then return '-' end
local listed = redis.call('HEXISTS', base .. 'replicas', failed) == 1
if listed and redis.call('HLEN', base .. 'replicas') == 1 then return failed end
redis.call('HDEL', base .. 'replicas', failed)
if redis.call('HLEN', base .. 'replicas') == 0 then
  redis.call('HSET', base .. 'replicas', 'none', 0)
end
unload(failed, r[5])
local rep = pick_replica(r[2], r[4], r[5])
if rep then
  redis.call('HINCRBY', base .. 'rload', rep, tonumber(r[5]) or 1)
  redis.call('HSET', key, 'replica', rep)
  return rep
end
deactivate(r[3])
unlend(rid, r[5])
redis.call('ZREM', base .. 'inflight', rid)
redis.call('DEL', key)
dispatch(nil)
return ''

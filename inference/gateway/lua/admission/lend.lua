-- A batch line asks an online pool for idle room (``Admission.borrow``): granted at once in
-- the lowest band, or refused at once ({'no', why}) — it never queues here. Room is lent only
-- while the pool lends (``lend``: the percent of its capacity it may lend, set by the catalog),
-- nothing waits in any band, the lent sequences stay within that share, and a replica has
-- room. ``reclaim`` (common.lua) takes it back when an online request needs it. Lent work is
-- not charged to the tenant's fairness counter here (it took room nobody wanted): its own
-- online requests on this pool are not put behind others' for its batch.
-- With ``probe`` set it lends nothing: {'room', replica} says it would now
-- (``Admission.lendable``: a line waiting in its own pool's queue leaves it only then).
-- ARGV: lease slack rid tenant weight est proc prefix adapter seqs [probe]
reap()
if redis.call('EXISTS', base .. 'replicas') == 0 then return {'nocatalog', ''} end
local share = tonumber(redis.call('GET', base .. 'lend') or '0') or 0
if share <= 0 then return {'no', 'lends nothing'} end
for band = 0, BANDS - 1 do
  if band_waits(band) then return {'no', 'requests wait'} end
end
local rid, tenant, weight, est, proc = ARGV[3], ARGV[4], ARGV[5], ARGV[6], ARGV[7]
local prefix, adapter, seqs = ARGV[8], ARGV[9], tonumber(ARGV[10]) or 1
local total = 0
for _, c in ipairs(redis.call('HVALS', base .. 'replicas')) do total = total + tonumber(c) end
local lent = tonumber(redis.call('GET', base .. 'lent_seqs') or '0')
if lent + seqs > math.floor(total * share / 100) then return {'no', 'share used'} end
local rep = pick_replica(prefix, adapter, seqs)
if not rep then return {'no', 'full'} end
if ARGV[11] == '1' then return {'room', rep} end
local band = BANDS - 1
local key = base .. 'req:' .. rid
redis.call('HSET', key, 'tenant', tenant, 'weight', weight, 'est', est, 'proc', proc,
  'prefix', prefix, 'adapter', adapter, 'seqs', seqs, 'state', 'granted', 'replica', rep,
  'band', band, 'lent', 1, 'deadline', now, 'since', now)
redis.call('PEXPIRE', key, 3600000)
redis.call('HINCRBY', base .. 'rload', rep, seqs)
redis.call('HINCRBY', base .. 'active', tenant, 1)
redis.call('ZADD', base .. 'inflight', now + LEASE, rid)
-- In the order lent (two in the same millisecond too): the newest is taken back first.
redis.call('ZADD', base .. 'lent', redis.call('INCR', base .. 'lent_serial'), rid)
redis.call('INCRBY', base .. 'lent_seqs', seqs)
redis.call('HINCRBY', base .. 'lending', 'lent', 1)
return {'granted', rep}

-- One pool's part of the serving catalog, written only where it differs from what Redis
-- holds (inference.catalog.catalog_publish, every probe round): a round that changes
-- nothing costs one call per pool and writes nothing, and a replica a gateway suspected
-- (admission's suspect.lua took it out of the ready set) is put back once a probe finds it
-- answering, as a full rewrite did.
-- KEYS[1] the pool's prefix (its hash tag): policy, lend and replicas are under it.
-- ARGV[1] policy, ARGV[2] lend percent, ARGV[3..] ready replica id, capacity pairs (none: no
-- capacity, written as the marker "none" = 0: an empty hash cannot exist).
-- Returns 1 when it wrote anything.
local base = KEYS[1]
local changed = 0
if redis.call('GET', base .. 'policy') ~= ARGV[1] then
  redis.call('SET', base .. 'policy', ARGV[1])
  changed = 1
end
if redis.call('GET', base .. 'lend') ~= ARGV[2] then
  redis.call('SET', base .. 'lend', ARGV[2])
  changed = 1
end
local want, n = {}, 0
for i = 3, #ARGV, 2 do
  want[ARGV[i]] = ARGV[i + 1]
  n = n + 1
end
if n == 0 then
  want['none'] = '0'
  n = 1
end
local have = redis.call('HGETALL', base .. 'replicas')
local same = (#have == 2 * n)
if same then
  for i = 1, #have, 2 do
    if want[have[i]] ~= have[i + 1] then
      same = false
      break
    end
  end
end
if not same then
  local pairs_ = {}
  for id, capacity in pairs(want) do
    pairs_[#pairs_ + 1] = id
    pairs_[#pairs_ + 1] = capacity
  end
  redis.call('DEL', base .. 'replicas')
  redis.call('HSET', base .. 'replicas', unpack(pairs_))
  changed = 1
end
return changed

reap()
local key = base .. 'req:' .. ARGV[3]
local r = redis.call('HMGET', key, 'tenant', 'weight', 'state', 'replica', 'seqs', 'band', 'lent')
if r[3] == 'granted' then
  local band = band_of(r[6])
  if r[7] ~= '1' then charge(r[1], band, tonumber(r[2]), tonumber(ARGV[4])) end
  redis.call('ZREM', base .. 'inflight', ARGV[3])
  redis.call('DEL', key)
  unlend(ARGV[3], r[5])
  -- Lent room is never held: a batch line's next one borrows again, or goes to its spot pool.
  if r[7] ~= '1' and ARGV[5] ~= 'nohold' and owed_hold(r[1], r[4], band) then
    redis.call('ZADD', base .. 'holds', now + HOLD,
      r[1] .. '|' .. r[4] .. '|' .. ARGV[3] .. '|' .. (r[5] or '1'))
  else
    unload(r[4], r[5])
    deactivate(r[1])
  end
end
dispatch(nil)
return 1

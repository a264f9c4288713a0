local rid = ARGV[3]
local key = base .. 'req:' .. rid
local r = redis.call('HMGET', key, 'tenant', 'state', 'replica', 'band')
if r[2] == 'granted' then return {'granted', r[3]} end
if r[2] == 'queued' then
  local band = band_of(r[4])
  redis.call('LREM', fcfs_key(band), 1, rid)
  if redis.call('LREM', qkey(band, r[1]), 1, rid) > 0 then leave_backlog_if_empty(band, r[1]) end
  redis.call('DEL', key)
  return {'cancelled', ''}
end
return {'gone', ''}

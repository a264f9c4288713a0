local rid = ARGV[3]
local key = base .. 'req:' .. rid
local r = redis.call('HMGET', key, 'tenant', 'state', 'replica')
if r[2] == 'granted' then return {'granted', r[3]} end
if r[2] == 'queued' then
  redis.call('LREM', base .. 'fcfs', 1, rid)
  if redis.call('LREM', base .. 'q:' .. r[1], 1, rid) > 0 then leave_backlog_if_empty(r[1]) end
  redis.call('DEL', key)
  return {'cancelled', ''}
end
return {'gone', ''}

local r = redis.call('HMGET', base .. 'req:' .. ARGV[3], 'tenant', 'weight', 'state')
if r[3] ~= 'granted' then return 0 end
charge(r[1], tonumber(r[2]), tonumber(ARGV[4]))
return 1

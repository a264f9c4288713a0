local r = redis.call('HMGET', base .. 'req:' .. ARGV[3], 'tenant', 'weight', 'state', 'band')
if r[3] ~= 'granted' then return 0 end
charge(r[1], band_of(r[4]), tonumber(r[2]), tonumber(ARGV[4]))
return 1

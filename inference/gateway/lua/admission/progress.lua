local r = redis.call('HMGET', base .. 'req:' .. ARGV[3], 'tenant', 'weight', 'state', 'band', 'lent')
if r[3] ~= 'granted' or r[5] == '1' then return 0 end  -- lent work is not charged (lend.lua)
charge(r[1], band_of(r[4]), tonumber(r[2]), tonumber(ARGV[4]))
return 1

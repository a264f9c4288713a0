for i = 3, #ARGV do
  redis.call('ZADD', base .. 'inflight', 'XX', now + LEASE, ARGV[i])
  redis.call('PEXPIRE', base .. 'req:' .. ARGV[i], 3600000)
end
return 1

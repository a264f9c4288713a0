if redis.call('HEXISTS', base .. 'replicas', ARGV[3]) == 0 then return 0 end
if redis.call('HLEN', base .. 'replicas') <= 1 then return 0 end
redis.call('HDEL', base .. 'replicas', ARGV[3])
return 1

redis.call('ZADD', KEYS[1], now, ARGV[1])
redis.call('HINCRBY', KEYS[2], ARGV[2], 1)
return 1

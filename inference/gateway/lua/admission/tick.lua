reap()
dispatch(nil)
return redis.call('ZCARD', base .. 'holds')

-- Token buckets shared by the limits scripts.
local function level(key, limit)
  local v = redis.call('HMGET', key, 't', 'ts')
  local tokens = tonumber(v[1])
  if tokens == nil then return limit end
  local refilled = tokens + (now - tonumber(v[2])) * limit / 60000
  if refilled > limit then refilled = limit end
  return refilled
end
local function store(key, tokens, limit)
  redis.call('HSET', key, 't', tostring(tokens), 'ts', now)
  redis.call('PEXPIRE', key, 60000 + math.ceil(math.max(0, limit - tokens) * 60000 / limit))
end

local member, est, actual = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
-- The budget notices this request's end crossed into (80% of a budget), for the caller to
-- hand to billing: billing's inbox is one list, in a slot of its own on a cluster.
local notices = {}
local function add(key, amount, limit, kind, scope, id)
  if amount <= 0 or redis.call('EXISTS', key) == 0 then return end
  local after = redis.call('INCRBY', key, amount)
  local before = after - amount
  if limit > 0 and before * 5 < limit * 4 and after * 5 >= limit * 4 then
    notices[#notices + 1] = table.concat({kind, scope, id, ARGV[13], after, limit}, '|')
  end
end
redis.call('ZREM', KEYS[2], member)
redis.call('ZREM', KEYS[5], member)
for _, b in ipairs({{1, 4}, {4, 5}}) do
  local limit = tonumber(ARGV[b[2]])
  if limit > 0 and redis.call('EXISTS', KEYS[b[1]]) == 1 then
    local left = level(KEYS[b[1]], limit) + est - actual
    if left > limit then left = limit end
    store(KEYS[b[1]], left, limit)
  end
end
local cost = tonumber(ARGV[6])
add(KEYS[3], actual, tonumber(ARGV[7]), 'tokens', 't', ARGV[11])
add(KEYS[6], actual, tonumber(ARGV[8]), 'tokens', 'k', ARGV[12])
add(KEYS[7], cost, tonumber(ARGV[9]), 'spend', 't', ARGV[11])
add(KEYS[8], cost, tonumber(ARGV[10]), 'spend', 'k', ARGV[12])
return notices

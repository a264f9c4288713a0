local held = redis.call('ZRANGE', KEYS[1], 0, -1)
if #held < tonumber(ARGV[2]) then return '' end
for _, name in ipairs(held) do
  if name ~= ARGV[1] and redis.call('ZCOUNT', ARGV[3] .. name, now, '+inf') == 0 then
    redis.call('ZREM', KEYS[1], name)
    return name
  end
end
return false

-- Moves the legacy spool list (KEYS[1]) into the usage stream (KEYS[2]) atomically, up to
-- ARGV[1] items; returns how many it moved (billing/spool.py, usage_spool_flush).
local items = redis.call('LRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)
for _, item in ipairs(items) do redis.call('XADD', KEYS[2], '*', 'r', item) end
if #items > 0 then redis.call('LTRIM', KEYS[1], #items, -1) end
return #items

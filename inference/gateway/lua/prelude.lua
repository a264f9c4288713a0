-- Shared by every script: the server's clock, in milliseconds.
local now
do
  local tm = redis.call('TIME')
  now = tonumber(tm[1]) * 1000 + math.floor(tonumber(tm[2]) / 1000)
end

-- ARGV: partition position  ->  what a web process's copy of the partition, read up to
-- ``position`` of its log (-1: none yet), lacks:
--   {'full', position now, {hash, vector, hash, vector, ...}}   the whole partition, or
--   {'since', position now, {"+hash" | "-hash", ...}, {vector of each "+hash" or nil}}
local fp, pos = ARGV[1], tonumber(ARGV[2])
local vecs, log, off = p .. 's:' .. fp, p .. 'sl:' .. fp, p .. 'so:' .. fp
local start = redis.call('GET', off)
local len = redis.call('LLEN', log)
if not start then
  -- Never stored, or expired with its answers: nothing a copy may keep.
  return { 'full', 0, redis.call('HGETALL', vecs) }
end
start = tonumber(start)
if pos < start or pos > start + len or start + len - pos > 1000 then
  return { 'full', start + len, redis.call('HGETALL', vecs) }
end
local entries = redis.call('LRANGE', log, pos - start, -1)
local added = {}
for _, entry in ipairs(entries) do
  if string.sub(entry, 1, 1) == '+' then
    added[#added + 1] = string.sub(entry, 2)
  end
end
local vectors = {}
if #added > 0 then
  vectors = redis.call('HMGET', vecs, unpack(added))
end
return { 'since', start + len, entries, vectors }

-- A probe round's start: the server's clock (ms) and the engines' last generated-token counts
-- (KEYS[1]: replica id -> "tokens|since"), in one call on one Redis or on the hash's node.
return {now, redis.call('HGETALL', KEYS[1])}

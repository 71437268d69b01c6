--[[ concurrency.lua: a semaphore of expiring leases (at most max_in_flight held at once).

The reference is allot_shared::limit::concurrency::Semaphore: acquire, renew and release here
answer exactly what it answers. A lease is live while its expiry is later than now; dead leases
are ignored and trimmed on the next write.

KEYS[1]  the lease set: a sorted set, member = lease id, score = the lease's expiry (epoch ms).

ARGV[1]  operation      "acquire", "renew" or "release".
ARGV[2]  now_ms         "0": read the server clock (TIME). Production always sends "0". A value
                        in [1, 2^50] is a test clock; key expiry follows it.
ARGV[3]  lease_id       1 to 64 bytes.
ARGV[4]  max_in_flight  [1, 2^40].
ARGV[5]  lease_ttl_ms   [1, 2^40].
All numbers are decimal integer strings.

Reply {held, in_flight}:
  acquire  held = 1 when the lease is held: newly (expiring at now + ttl), or already (idempotent:
           no second slot, expiry unchanged); 0 when max_in_flight live leases are held by others.
  renew    held = 1 when the lease was live and now expires at max(its expiry, now + ttl);
           0 when it lapsed or never existed (a heartbeat cannot resurrect a lease).
  release  held = 1 when the lease was live before this call. Idempotent: releasing twice, or
           releasing a lapsed lease, changes nothing.
  in_flight  live leases after the operation.
An acquire or renew that holds a lease drops the dead leases and sets the key's expiry to the
latest lease expiry (PEXPIREAT), so the key lives exactly as long as some lease could. A release
drops the lease and the dead leases and leaves the key's expiry as it was (it is already at least
the latest remaining expiry). A refused acquire or renew writes nothing.
Error replies (nothing written): ALLOT_ARG (invalid argument), ALLOT_STATE (not a sorted set).
]]

local TWO_40 = 1099511627776
local TWO_50 = 1125899906842624
local MAX_LEASE_ID_BYTES = 64

-- A decimal integer argument in [min, max], or nil (see decide.lua: no sign, exponent, hex, nan).
local function integer(text, min, max)
  if type(text) ~= 'string' or #text == 0 or #text > 16 or not string.find(text, '^%d+$') then
    return nil
  end
  local value = tonumber(text)
  if value == nil or value ~= value or value < min or value > max then
    return nil
  end
  return value
end

-- Integers leave the script through '%d': tostring keeps only 14 digits.
local function text(value)
  return string.format('%d', value)
end

if #KEYS ~= 1 or #ARGV ~= 5 then
  return { err = 'ALLOT_ARG expected 1 key and 5 arguments' }
end
local operation, lease_id = ARGV[1], ARGV[3]
if operation ~= 'acquire' and operation ~= 'renew' and operation ~= 'release' then
  return { err = 'ALLOT_ARG operation must be acquire, renew or release' }
end
if #lease_id == 0 or #lease_id > MAX_LEASE_ID_BYTES then
  return { err = 'ALLOT_ARG lease id must be 1 to ' .. MAX_LEASE_ID_BYTES .. ' bytes' }
end
local max_in_flight = integer(ARGV[4], 1, TWO_40)
local lease_ttl_ms = integer(ARGV[5], 1, TWO_40)
if max_in_flight == nil or lease_ttl_ms == nil then
  return { err = 'ALLOT_ARG max in flight and lease ttl must be in [1, 2^40]' }
end
local now
if ARGV[2] == '0' then
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
else
  now = integer(ARGV[2], 1, TWO_50)
  if now == nil then
    return { err = 'ALLOT_ARG now must be 0 (server clock) or in [1, 2^50]' }
  end
end

local key = KEYS[1]
-- Live leases expire after now: scores in (now, +inf].
local live_from = '(' .. text(now)
local in_flight = redis.pcall('ZCOUNT', key, live_from, '+inf')
if type(in_flight) == 'table' and in_flight.err then
  return { err = 'ALLOT_STATE the lease set is not a sorted set' }
end
local expiry = redis.call('ZSCORE', key, lease_id)
local held = expiry and tonumber(expiry) > now

-- Drops dead leases, sets `lease_id` to expire at `expires_at`, and makes the key live exactly as
-- long as its latest lease.
local function hold(expires_at)
  redis.call('ZREMRANGEBYSCORE', key, '-inf', text(now))
  redis.call('ZADD', key, text(expires_at), lease_id)
  local latest = redis.call('ZRANGE', key, -1, -1, 'WITHSCORES')
  redis.call('PEXPIREAT', key, latest[2])
end

if operation == 'acquire' then
  if held then
    return { 1, in_flight }
  end
  if in_flight >= max_in_flight then
    return { 0, in_flight }
  end
  hold(now + lease_ttl_ms)
  return { 1, in_flight + 1 }
elseif operation == 'renew' then
  if not held then
    return { 0, in_flight }
  end
  hold(math.max(tonumber(expiry), now + lease_ttl_ms))
  return { 1, in_flight }
end
-- release
redis.call('ZREMRANGEBYSCORE', key, '-inf', text(now))
redis.call('ZREM', key, lease_id)
if held then
  return { 1, in_flight - 1 }
end
return { 0, in_flight }

#!lua name=allot_decide_LIBRARY_VERSION
--[[ decide.lua: one all-or-nothing decision over every regional rule of one request, as a Redis
function library (Redis 7): loaded once with FUNCTION LOAD, called with
FCALL allot_decide_LIBRARY_VERSION. The store substitutes LIBRARY_VERSION with the first 16 hex
digits of the SHA-1 of this text, so agents of two versions never call each other's code.

The reference is allot_shared::limit::multi::decide_all: this function must return exactly what it
returns (allowed, first denying rule, retry hint, advisory denials, per-rule remaining) and write
exactly its writes.

KEYS[1]        the decision record (a string). Read and written only when record_ttl_ms > 0.
KEYS[2..n+1]   one key per rule, all distinct.
               A request that keeps no decision record and has no sliding log may go without
               KEYS[1] and without the decision id (ARGV[2]): n keys and 1 + n arguments, the
               rules from ARGV[2]. The agent sends such requests so; the function tells the two
               layouts apart by their counts. Every key, KEYS[1] included, carries the same
               {t:<tenant>} hash tag, so they share one Redis Cluster slot and this one call
               decides them atomically.

ARGV[1]  the header, five decimal fields separated by one space:
         "<now_ms> <record_ttl_ms> <n> <dry_run> <advisory> <hashes>"
         now_ms          0: read the server clock (TIME). Production always sends 0. A value in
                         [1, 2^50] is a test clock: differential tests drive time with it, and key
                         expiry follows it (PEXPIREAT now + ttl).
         record_ttl_ms   0: no decision record. In [1, 2^40]: an admission is recorded under
                         KEYS[1] for this long, and a call that finds the record replays it
                         without deciding (or debiting) again.
         n               the number of rules, 1 to 8. #KEYS = n + 1 and #ARGV = 2 + n (or n and 1 + n).
         dry_run         1: decide and reply as usual, but write nothing (no rule state, no
                         decision record): a check that spends nothing. 0: a decision.
         advisory        a bit mask in [0, 2^n - 1]: bit i-1 set when rule i only advises (a shadow
                         or soft rule). An advisory rule never denies: the request is decided by
                         the others; when it is admitted, an advisory rule is written only if it
                         admits too.
         hashes          1: write tb, fw and sc state as the hashes of earlier versions (which
                         cannot read the strings), for a rolling upgrade from such a version.
                         0: as strings. Both are read either way.
ARGV[2]  decision_id     1 to 64 bytes: the sliding log's member.
ARGV[2 + i]  rule i (1-based), six fields separated by one space:
         algorithm  p1                    p2                  p3         p4        p5
         "tb"       capacity_millitokens  refill_millitokens  period_ms  slack_ms  cost_millitokens
         "gcra"     capacity_millitokens  refill_millitokens  period_ms  0         cost_millitokens
         "fw" "sc" "sl"  limit_units      window_ms           0          0         cost_millitokens
         Window algorithms count whole units: their cost must be a multiple of 1000 millitokens,
         and exactly 1000 for the sliding log (one entry per request).

Every number is a decimal integer (no sign, exponent, fraction, hex, "nan" or "inf"). Parameters
lie in [1, 2^40] (slack in [0, 2^40]) and capacity x period (limit x window) is at most 2^52: then
every intermediate value stays below 2^53, where Lua's doubles are exact integers, and this function
computes exactly what the Rust core computes.

Validated once per text: a header or rule argument is parsed and validated in full the first time
this library sees that exact text, and the result (never changed, but for the meaning a coalesced
call's layout last had, which it keeps for the next call) is kept in a bounded table of the
library (at most MAX_PARSED entries, emptied when full). A later call with the same text reuses the
validated parse: identical bytes in, identical parse out, so no check is skipped for any input
(docs/limiter.md argues it).

Reply "allowed denied_by retry_ms replayed advisory_denied remaining_1 ... remaining_n": one string,
or, for a request of one rule that the rule admits, decided on its own path (the single-rule
path, not a replay, no advisory rule), the integer remaining_1 alone: the same as
"1 0 0 0 0 remaining_1", without a string made for it. The string is
decimal integers one space apart (Redis turns a table reply into its protocol at a cost per element
and per table, several times a string's):
  allowed     1 or 0.
  denied_by   1-based index of the first denying (enforced) rule, 0 when allowed.
  retry_ms    0 when allowed; otherwise the maximum over denying enforced rules, -1 (never)
              dominating.
  replayed    1 when the reply is a stored decision record, else 0.
  advisory_denied  the mask of the advisory rules that would have denied (0 in a replay).
  remaining   per rule, in its unit (millitokens or units): after the debit when allowed,
              untouched when denied. A replay returns the remaining of the recorded decision.
Error replies (nothing is written; the client treats them as a fault, never as a denial):
  ALLOT_ARG    an argument failed validation (a policy or client defect).
  ALLOT_STATE  a key holds the state of another algorithm, or a corrupt value.

Stored state, one key per rule:
  tb    string "t<tokens (millitokens)> <updated at (ms)>"
  gcra  string: the theoretical arrival time (ms)
  fw    string "f<window start (ms)> <units admitted in it>"
  sc    string "s<current window start (ms)> <its units> <the previous window's units>"
  sl    sorted set: member = decision id, score = admission time (ms)
  Numbers in decimal, one space apart; the letter names the algorithm, so that a rule never takes
  another algorithm's state for its own. One GET reads a state and one SET writes it with its
  expiry. Earlier versions kept tb, fw and sc in hashes ({tk, ts}, {w, n}, {w, cur, prev}): such a
  hash is still read, and the next write replaces it with the string.
  the decision record: string "remaining_1 ... remaining_n" of an admission
A denial writes nothing, and neither does a dry run. Every write sets the key's expiry in the same
call, at the TTL the pure core computes (SET ... PXAT now + ttl, or PEXPIREAT for a sorted set;
on the server clock both equal a relative TTL).
]]

local TWO_40 = 1099511627776
local TWO_50 = 1125899906842624
local TWO_52 = 4503599627370496
local TWO_53 = 9007199254740992
-- The largest stored number read back: below 2^53 every decimal integer converts to exactly its
-- double, so a longer one (2^53 + 1, say) cannot pass for its rounded neighbour.
local MAX_STORED = TWO_53 - 1
local MAX_RULES = 8
local MILLITOKENS_PER_UNIT = 1000
local MAX_DECISION_ID_BYTES = 64
-- Most parsed arguments kept (headers and rules together); past it the table starts empty again.
local MAX_PARSED = 4096

-- Cost: this code runs on the store's one thread for every decision, and in Redis's Lua a call of a
-- C function (string.find, tonumber, math.floor, type, pairs, next) costs about as much as a small
-- Redis command. The hot path calls as few as it can: arithmetic coerces digit strings itself,
-- integer division uses `%`, and min and max are written out.
--
-- The library functions it calls are locals, bound by the first call (bind_library): a function's
-- globals are an empty table that looks names up in Redis's through a metatable, so `string.format`
-- cost two table misses, a metamethod and two lookups on every use (about 1,400 instructions per
-- decision of a hot tenant's). They cannot be bound as the library loads: while it loads, only
-- the API that registers functions is reachable.
local format, find, match, sub, gmatch, concat, max, floor
local unpack_values, to_number, type_of, pairs_of, redis_call, redis_pcall

local function bind_library()
  format, find, match, sub, gmatch = string.format, string.find, string.match, string.sub, string.gmatch
  concat, max, floor = table.concat, math.max, math.floor
  unpack_values, to_number, type_of, pairs_of = unpack, tonumber, type, pairs
  redis_call, redis_pcall = redis.call, redis.pcall
end

-- A decimal integer in [min, max], or nil. Every caller passes a string or nil (arguments, hash
-- fields and string values are strings in Redis). The pattern refuses what tonumber would accept
-- ("1e3", "0x10", " 1", "inf", "nan"); digits alone coerce to exactly the number they spell.
local function integer(text, min, max)
  if text == nil or #text == 0 or #text > 16 or not find(text, '^%d+$') then
    return nil
  end
  local value = text + 0
  if value < min or value > max then
    return nil
  end
  return value
end

-- An integer in [0, 2^53] as decimal digits. Not tostring or `..`: they keep 14 significant
-- digits, and they format as a float ('%.14g'), which costs several times what '%d' does.
local function text(value)
  return format('%d', value)
end

-- The last two numbers shared_text() formatted, and their digits.
local last_value, last_digits, other_value, other_digits

-- text(value) for numbers many writes share: an expiry (a window's end, or the call's clock plus a
-- bucket's refill time) and a sliding counter's window start. string.format costs as much as a small Redis command, and the
-- decisions of a call (and of one window) write the same few of these again and again.
--@inline
local function shared_text(value)
  local digits = last_digits
  if value ~= last_value then
    if value == other_value then
      digits = other_digits
    else
      other_value, other_digits = last_value, last_digits
      last_value, last_digits = value, format('%d', value)
      digits = last_digits
    end
  end
  return digits
end

-- floor(a / b) for integers 0 <= a < 2^53 and b >= 1. Lua's `a % b` is a - floor(a / b) * b: the
-- double quotient is off by less than 1/b, which never reaches the next integer, so the floor is
-- the exact integer quotient, every product and difference here is an exact integer, and so is
-- the result.
local function div_floor(a, b)
  return (a - a % b) / b
end

-- ceil(a / b) under the same bounds (a + b - 1 stays below 2^53: a <= 2^52 + 2^40, b <= 2^40).
local function div_ceil(a, b)
  local c = a + b - 1
  return (c - c % b) / b
end

local function arg_error(message)
  return { err = 'ALLOT_ARG ' .. message }
end

local function state_error(where, message)
  return { err = 'ALLOT_STATE ' .. where .. ': ' .. message }
end

-- The fields of `argument` split at single spaces (an empty field where two spaces meet), or nil
-- when there are not `count` of them.
local function fields(argument, count)
  if type_of(argument) ~= 'string' then
    return nil
  end
  local parts = {}
  for part in gmatch(argument .. ' ', '([^ ]*) ') do
    parts[#parts + 1] = part
  end
  if #parts ~= count or concat(parts, ' ') ~= argument then
    return nil
  end
  return parts
end

-- Parsed arguments by their exact text: {ok = parsed} or {err = the message}; an error is kept too,
-- so a defective caller cannot make every call parse again.
local parsed_by_text, parsed_count = {}, 0

local function remember(argument, entry)
  if parsed_count >= MAX_PARSED then
    parsed_by_text, parsed_count = {}, 0
  end
  parsed_by_text[argument] = entry
  parsed_count = parsed_count + 1
  return entry
end

-- Header ---------------------------------------------------------------------------------------

local function parse_header(argument)
  local parts = fields(argument, 6)
  if parts == nil then
    return { err = 'the header must be six fields: now, record ttl, n, dry run, advisory, hashes' }
  end
  local header = {}
  if parts[6] ~= '0' and parts[6] ~= '1' then
    return { err = 'hashes must be 0 or 1' }
  end
  header.hashes = parts[6] == '1'
  header.n = integer(parts[3], 1, MAX_RULES)
  if header.n == nil then
    return { err = 'n must be 1 to ' .. MAX_RULES }
  end
  if parts[4] ~= '0' and parts[4] ~= '1' then
    return { err = 'dry run must be 0 or 1' }
  end
  header.dry_run = parts[4] == '1'
  header.advisory_mask = integer(parts[5], 0, 2 ^ header.n - 1)
  if header.advisory_mask == nil then
    return { err = 'advisory must be a mask of the n rules' }
  end
  -- Whether rule i only advises: bit i-1 of the mask.
  header.advisory = {}
  for i = 1, header.n do
    header.advisory[i] = floor(header.advisory_mask / 2 ^ (i - 1)) % 2 == 1
  end
  header.record_ttl_ms = integer(parts[2], 0, TWO_40)
  if header.record_ttl_ms == nil then
    return { err = 'record ttl must be in [0, 2^40]' }
  end
  if parts[1] == '0' then
    header.server_time = true
  else
    header.now = integer(parts[1], 1, TWO_50)
    if header.now == nil then
      return { err = 'now must be 0 (server clock) or in [1, 2^50]' }
    end
  end
  -- The shape decide_plain serves: no decision record, no dry run, no advisory rule, state
  -- written as strings.
  header.plain = header.record_ttl_ms == 0 and not header.dry_run and header.advisory_mask == 0
    and not header.hashes
  return { ok = header }
end

-- Rules ----------------------------------------------------------------------------------------

-- A rule's algorithm, parameters and cost (in the rule's own unit), validated, with what its
-- decision derives from them alone; or {err = the message, without the rule's index}. An invalid
-- cost alone is kept as `cost_err`: the core checks the cost after the stored state's shape.
local function parse_rule(argument)
  local parts = fields(argument, 6)
  if parts == nil then
    return { err = 'a rule must be six fields: algorithm, four parameters, cost' }
  end
  local kind = parts[1]
  local spec = { kind = kind }
  local where = '(' .. kind .. '): '
  if kind == 'tb' or kind == 'gcra' then
    spec.capacity = integer(parts[2], 1, TWO_40)
    spec.refill = integer(parts[3], 1, TWO_40)
    spec.period = integer(parts[4], 1, TWO_40)
    if kind == 'tb' then
      spec.slack = integer(parts[5], 0, TWO_40)
    elseif parts[5] == '0' then
      spec.slack = 0
    end
    if not (spec.capacity and spec.refill and spec.period and spec.slack) then
      return { err = where .. 'capacity, refill and period must be in [1, 2^40], slack in [0, 2^40]' }
    end
    -- Both factors are at most 2^40: an inexact product is above 2^53, so the test still holds.
    if spec.capacity * spec.period > TWO_52 then
      return { err = where .. 'capacity x period must be at most 2^52' }
    end
  elseif kind == 'fw' or kind == 'sc' or kind == 'sl' then
    spec.limit = integer(parts[2], 1, TWO_40)
    spec.window = integer(parts[3], 1, TWO_40)
    if not (spec.limit and spec.window and parts[4] == '0' and parts[5] == '0') then
      return { err = where .. 'limit and window must be in [1, 2^40], then two zeros' }
    end
    if spec.limit * spec.window > TWO_52 then
      return { err = where .. 'limit x window must be at most 2^52' }
    end
  else
    return { err = where .. 'unknown algorithm' }
  end
  local cost_millitokens = integer(parts[6], 1, TWO_40 * MILLITOKENS_PER_UNIT)
  if kind == 'tb' or kind == 'gcra' then
    if cost_millitokens == nil or cost_millitokens > TWO_40 then
      spec.cost_err = where .. 'cost must be in [1, 2^40] millitokens'
      return { ok = spec }
    end
    spec.cost = cost_millitokens
  else
    if cost_millitokens == nil or cost_millitokens % MILLITOKENS_PER_UNIT ~= 0 then
      spec.cost_err = where .. 'cost must be a positive multiple of 1000 millitokens'
      return { ok = spec }
    end
    spec.cost = cost_millitokens / MILLITOKENS_PER_UNIT
    if kind == 'sl' and spec.cost ~= 1 then
      spec.cost_err = where .. 'cost must be exactly 1000 millitokens for the sliding log'
      return { ok = spec }
    end
  end
  -- What the decision derives from the parameters alone.
  if kind == 'tb' then
    spec.full_refill_ms = div_ceil(spec.capacity * spec.period, spec.refill)
  elseif kind == 'gcra' then
    spec.burst_ms = div_floor(spec.capacity * spec.period, spec.refill)
    spec.increment_ms = div_ceil(spec.cost * spec.period, spec.refill)
  end
  -- A rule decide_plain serves: valid, and a token bucket or a fixed window.
  spec.plain = kind == 'tb' or kind == 'fw'
  return { ok = spec }
end

-- `argument` parsed by `parse`, from the table when this exact text was seen before.
--@inline
local function parsed(argument, parse)
  local entry = parsed_by_text[argument]
  if entry == nil then
    if argument == nil then
      entry = parse(argument)
    else
      entry = remember(argument, parse(argument))
    end
  end
  return entry
end

-- Stored state ---------------------------------------------------------------------------------

-- The string layouts of tb, fw and sc (see the header comment), to match (`write` and
-- decide_plain write them).
local STATE_PATTERNS = {
  tb = '^t(%d+) (%d+)$',
  fw = '^f(%d+) (%d+)$',
  sc = '^s(%d+) (%d+) (%d+)$',
}

-- The hashes of earlier versions, by algorithm.
local HASH_SHAPES = {
  tb = { tk = true, ts = true },
  fw = { w = true, n = true },
  sc = { w = true, cur = true, prev = true },
}
-- Fields per shape: a hash's field names are distinct, so a hash of only expected fields with
-- this many of them has every one.
local HASH_FIELD_COUNTS = { tb = 2, fw = 2, sc = 3 }

-- The hash an earlier version wrote for a tb, fw or sc rule: nil when absent, a table of its
-- fields, or an error reply. One HGETALL: every field the key holds comes back, so a field of
-- another algorithm is seen too.
local function read_hash(rule_index, key, kind)
  local values = redis_pcall('HGETALL', key)
  if values.err then
    return nil, state_error('rule ' .. rule_index, 'the key is not a hash')
  end
  local count = #values
  if count == 0 then
    return nil
  end
  local found, expected = {}, HASH_SHAPES[kind]
  for f = 1, count, 2 do
    local name, digits = values[f], values[f + 1]
    if not expected[name] then
      return nil, state_error('rule ' .. rule_index, 'field ' .. name .. ' belongs to another algorithm')
    end
    local value = integer(digits, 0, MAX_STORED)
    if value == nil then
      return nil, state_error('rule ' .. rule_index, 'field ' .. name .. ' is not an integer')
    end
    found[name] = value
  end
  if count ~= 2 * HASH_FIELD_COUNTS[kind] then
    for name in pairs_of(expected) do
      if found[name] == nil then
        return nil, state_error('rule ' .. rule_index, 'field ' .. name .. ' is missing')
      end
    end
  end
  return found
end

-- Why a tb, fw or sc state string does not match its algorithm's layout (the slow path: a fault).
-- Rule `rule_index`'s key holds (or a coalesced call carries for it) algorithm `other`'s state.
local function another_algorithm(rule_index, other)
  return state_error('rule ' .. rule_index,
    'the key holds the state of another algorithm (' .. other .. ')')
end

local function string_state_problem(rule_index, kind, stored)
  for other, pattern in pairs_of(STATE_PATTERNS) do
    if other ~= kind and find(stored, pattern) then
      return another_algorithm(rule_index, other)
    end
  end
  local where = 'rule ' .. rule_index
  return state_error(where, 'the key does not hold a ' .. kind .. ' state')
end

-- The numbers of a tb, fw or sc state string, or nil when it does not hold exactly `kind`'s
-- layout: one match checks the layout and captures every field, each at most 16 digits and below
-- 2^53 (exact integers, as integer() requires). The third number is nil but for sc.
--@inline
local function state_numbers(stored, kind)
  local a, b, c = match(stored, STATE_PATTERNS[kind])
  if a == nil or #a > 16 or #b > 16 or (c and #c > 16) then
    a = nil
  else
    a, b = a + 0, b + 0
    if c then
      c = c + 0
    end
    if a > MAX_STORED or b > MAX_STORED or (c and c > MAX_STORED) then
      a = nil
    end
  end
  return a, b, c
end

-- The state of a tb, fw or sc rule: nil when absent, a table of its fields (named as the hashes
-- of earlier versions named them), or an error reply. One GET; a hash is an earlier version's
-- state.
local function read_string_state(rule_index, key, kind)
  local stored = redis_pcall('GET', key)
  if not stored then
    return nil
  end
  -- A string's fields are the string library's (stored.err is nil); only an error reply has one.
  if stored.err then
    return read_hash(rule_index, key, kind)
  end
  local a, b, c = state_numbers(stored, kind)
  if a == nil then
    return nil, string_state_problem(rule_index, kind, stored)
  end
  if kind == 'tb' then
    return { tk = a, ts = b }
  elseif kind == 'fw' then
    return { w = a, n = b }
  end
  return { w = a, cur = b, prev = c }
end

-- The GCRA key: nil when absent, the stored TAT, or an error reply.
local function read_tat(rule_index, key)
  local stored = redis_pcall('GET', key)
  -- A string's fields are the string library's (stored.err is nil); only an error reply has one.
  if stored and stored.err then
    return nil, state_error('rule ' .. rule_index, 'the key is not a string')
  end
  if not stored then
    return nil
  end
  local tat = integer(stored, 0, MAX_STORED)
  if tat == nil then
    return nil, state_error('rule ' .. rule_index, 'the TAT is not an integer')
  end
  return tat
end

-- The sliding-log key, read against now: {live_count = entries admitted after now - window (later
-- than now too, if the clock stepped back), replay = this decision id is one of them}; or an error
-- reply. An entry admitted exactly a window ago has left.
local function read_log(rule_index, key, window, now, decision_id)
  local live_from = '(' .. text(now - window)
  local live_count = redis_pcall('ZCOUNT', key, live_from, '+inf')
  if type_of(live_count) == 'table' and live_count.err then
    return nil, state_error('rule ' .. rule_index, 'the key is not a sorted set')
  end
  local admitted_at = redis_call('ZSCORE', key, decision_id)
  local replay = admitted_at and to_number(admitted_at) > now - window
  return { live_count = live_count, live_from = live_from, replay = replay }
end

local function read_state(index, spec, key, now, decision_id)
  if spec.kind == 'gcra' then
    return read_tat(index, key)
  elseif spec.kind == 'sl' then
    return read_log(index, key, spec.window, now, decision_id)
  end
  return read_string_state(index, key, spec.kind)
end

-- Decisions ------------------------------------------------------------------------------------
-- Each decide_* returns an outcome:
--   allowed    this rule admits the request
--   remaining  after this rule's own decision (after its debit when allowed)
--   available  what it holds without debiting, reported when another rule denies
--   retry      when denied: ms, or -1 for never
--   write      when allowed: true when the rule writes (not for a sliding-log replay), with what
--              it writes in the outcome's other fields (see `write`)
-- Costs are in the rule's unit: millitokens for tb and gcra, units for fw, sc and sl.

local function never()
  return { allowed = false, remaining = 0, available = 0, retry = -1 }
end

-- A token bucket's tokens at `now` and the time it then holds, from the tokens and time it
-- stored (both nil when the key is empty: a full bucket). Every path of the library refills
-- through here. Inlined where it is called (scripts.rs expands the library): a call would cost
-- about 900 instructions, more than the refill itself.
--@inline
local function refilled(rule, stored_tokens, stored_at, now)
  local tokens, at = stored_tokens, stored_at
  local capacity = rule.capacity
  if stored_tokens == nil then
    tokens, at = capacity, now
  elseif now > stored_at then
    -- Refilled since it was stored. Nothing is when it was written at this instant (each request
    -- of a coalesced call after the first), or when the clock stepped back, which never moves
    -- the stored time back.
    local delta_ms = now - stored_at
    if delta_ms > rule.full_refill_ms then
      delta_ms = rule.full_refill_ms
    end
    -- delta_ms * refill <= capacity * period + refill < 2^53; its floor division by period is
    -- div_floor's, written out.
    local gained, period = delta_ms * rule.refill, rule.period
    tokens, at = stored_tokens + (gained - gained % period) / period, now
  end
  -- The clamp to capacity also covers tokens stored under a larger capacity: a tightened policy
  -- applies on the next call.
  if tokens > capacity then
    tokens = capacity
  end
  return tokens, at
end

-- The two plain algorithms' decisions, each written once: every path of the library decides a
-- token bucket or a fixed window through these (the general path through decide_token_bucket and
-- decide_fixed_window, the plain paths through plain_step), and each is inlined where it is
-- called. From the rule and the two numbers its state holds (nil when the key is empty), each
-- returns what the rule holds before any debit (reported when the request is denied); the wait
-- when it denies (ms, -1 for never), else nil; and the two numbers an admission writes (tokens
-- left and the time they are counted at; the window's start and its count), the second nil when
-- it denies. An admission leaves the rule holding what it held less the cost, for both.

--@inline
local function token_bucket_step(spec, now, stored_tokens, stored_at)
  local held, wait_ms, tokens_left, updated_at = 0, -1, nil, nil
  local cost = spec.cost
  if cost <= spec.capacity then
    held, updated_at = refilled(spec, stored_tokens, stored_at, now)
    if held < cost then
      -- deficit <= capacity, so deficit * period <= 2^52.
      wait_ms = div_ceil((cost - held) * spec.period, spec.refill)
    else
      wait_ms, tokens_left = nil, held - cost
    end
  end
  return held, wait_ms, tokens_left, updated_at
end

--@inline
local function fixed_window_step(spec, now, stored_start, stored_count)
  local window = spec.window
  local held, wait_ms, window_start, new_count = 0, -1, now - now % window, nil
  local limit, cost, count = spec.limit, spec.cost, 0
  -- A stored window later than now's (the clock stepped back) is kept: stricter, never a reset.
  if stored_start and stored_start >= window_start then
    window_start, count = stored_start, stored_count
  end
  if cost <= limit then
    held = limit > count and limit - count or 0
    if count + cost > limit then
      wait_ms = window_start + window - now
    else
      wait_ms, new_count = nil, count + cost
    end
  end
  return held, wait_ms, window_start, new_count
end

-- A plain rule's decision (a token bucket's or a fixed window's), as the two steps above return it.
--@inline
local function plain_step(spec, kind, now, stored_first, stored_second)
  local held, wait_ms, first, second
  if kind == 'fw' then
    held, wait_ms, first, second = fixed_window_step(spec, now, stored_first, stored_second)
  else
    held, wait_ms, first, second = token_bucket_step(spec, now, stored_first, stored_second)
  end
  return held, wait_ms, first, second
end

local function decide_token_bucket(rule, state, now)
  local stored_tokens, stored_at = state and state.tk, state and state.ts
  local held, wait_ms, tokens_left, updated_at = token_bucket_step(rule, now, stored_tokens, stored_at)
  if wait_ms then
    return { allowed = false, remaining = held, available = held, retry = wait_ms }
  end
  -- The key lives until the stored state would be full again: full refill + slack counted from
  -- updated_at, which a clock that stepped back leaves ahead of now (as the core does).
  return {
    allowed = true, remaining = tokens_left, available = held,
    write = true, updated_at = updated_at, expires_at = updated_at + rule.full_refill_ms + rule.slack,
  }
end

local function decide_gcra(rule, tat, now)
  if rule.cost > rule.capacity then return never() end
  local burst_ms = rule.burst_ms
  local refill, period = rule.refill, rule.period
  -- How far the TAT runs ahead of now (0 for a fresh key or a TAT in the past). The core's
  -- new_tat - now is used + increment; it is compared term by term so no sum passes 2^53.
  local used_ms = 0
  if tat and tat > now then
    used_ms = tat - now
  end
  local increment_ms = rule.increment_ms
  -- The millitokens a span of the tolerance holds: span <= burst, so span * refill <= capacity *
  -- period <= 2^52.
  local available = div_floor((used_ms < burst_ms and burst_ms - used_ms or 0) * refill, period)
  if used_ms > burst_ms or increment_ms > burst_ms - used_ms then
    -- The excess of used + increment over the tolerance.
    local retry = (used_ms - burst_ms) + increment_ms
    return { allowed = false, remaining = available, available = available, retry = retry }
  end
  -- Admitted: new_tat = now + used + increment <= now + burst, and the key lives until then.
  return {
    allowed = true, remaining = div_floor((burst_ms - used_ms - increment_ms) * refill, period),
    available = available,
    write = true, new_tat = now + used_ms + increment_ms,
  }
end

local function decide_fixed_window(rule, state, now)
  local stored_start, stored_count = state and state.w, state and state.n
  local held, wait_ms, window_start, count = fixed_window_step(rule, now, stored_start, stored_count)
  if wait_ms then
    return { allowed = false, remaining = held, available = held, retry = wait_ms }
  end
  -- The key lives until the window ends.
  return {
    allowed = true, remaining = rule.limit - count, available = held,
    write = true, window_start = window_start, count = count, expires_at = window_start + rule.window,
  }
end

local function decide_sliding_counter(rule, state, now)
  if rule.cost > rule.limit then return never() end
  local w = rule.window
  local start = now - now % w
  -- Roll the stored windows forward to now's. `effective` is the time the estimate is taken at: a
  -- stored window later than now's (the clock stepped back) is kept and judged at its start.
  local window_start, cur, prev, effective = start, 0, 0, now
  if state then
    if state.w > start then
      window_start, cur, prev, effective = state.w, state.cur, state.prev, state.w
    elseif state.w == start then
      cur, prev = state.cur, state.prev
    elseif start - state.w == w then
      prev = state.cur
    end
  end
  local elapsed = effective - window_start
  -- headroom = limit * w - (prev * (w - elapsed) + cur * w), subtracted term by term so that it
  -- stays exact: a term above the headroom (even one past 2^53, after a window change) already
  -- means "over", and comparing it needs no exactness.
  local headroom, over = rule.limit * w, false
  local weighted_prev, full_cur = prev * (w - elapsed), cur * w
  if weighted_prev > headroom then
    over = true
  else
    headroom = headroom - weighted_prev
    if full_cur > headroom then
      over = true
    else
      headroom = headroom - full_cur
    end
  end
  local available = over and 0 or div_floor(headroom, w)
  local cost_scaled = rule.cost * w
  if not over and cost_scaled <= headroom then
    -- The state matters until both counts have aged out: the end of the next window.
    return {
      allowed = true, remaining = div_floor(headroom - cost_scaled, w), available = available,
      write = true, window_start = window_start, count = cur + rule.cost, prev = prev,
      expires_at = window_start + 2 * w,
    }
  end
  -- The earliest elapsed time e with weight * (w - e) <= slack is w - floor(slack / weight).
  local wait
  if cur + rule.cost <= rule.limit then
    -- Within this window (prev > 0 here, or the request would have been admitted).
    wait = (w - div_floor((rule.limit - cur - rule.cost) * w, prev)) - elapsed
  else
    -- Only in the next window, where the current count becomes the weighted one (cur > 0 here).
    wait = (w - elapsed) + (w - div_floor((rule.limit - rule.cost) * w, cur))
  end
  local retry = max(wait + (effective - now), 1)
  return { allowed = false, remaining = available, available = available, retry = retry }
end

local function decide_sliding_log(rule, log, now, key)
  local available = max(rule.limit - log.live_count, 0)
  if log.replay then
    -- A retry of an admitted request: allowed again, counted once, nothing written.
    return { allowed = true, remaining = available, available = available }
  end
  if log.live_count >= rule.limit then
    local oldest = redis_call('ZRANGEBYSCORE', key, log.live_from, '+inf', 'WITHSCORES', 'LIMIT', 0, 1)
    local retry = max(to_number(oldest[2]) + rule.window - now, 1)
    return { allowed = false, remaining = 0, available = available, retry = retry }
  end
  return { allowed = true, remaining = rule.limit - log.live_count - 1, available = available, write = true }
end

local DECIDE = {
  tb = decide_token_bucket,
  gcra = decide_gcra,
  fw = decide_fixed_window,
  sc = decide_sliding_counter,
  sl = decide_sliding_log,
}

-- One string.format makes a tb or fw state: formatting a field at a time made a string per field.
local STATE_FORMAT = { tb = 't%d %d', fw = 'f%d %d' }

-- Writes a tb or fw state string (its two numbers as STATE_PATTERNS lays them out) and its expiry
-- in one SET, which also replaces an earlier version's hash.
local function set_string_state(kind, key, first, second, expires_at)
  local expiry = shared_text(expires_at)
  redis_call('SET', key, format(STATE_FORMAT[kind], first, second), 'PXAT', expiry)
end

-- When a plain rule's state `first` and `second` (as the string holds them) expires: a bucket
-- lives until it would be full again (full refill + slack from its time, which a clock that
-- stepped back leaves ahead of now, as the core does); a window until its end.
--@inline
local function plain_expires_at(spec, kind, first, second)
  return kind == 'tb' and second + spec.full_refill_ms + spec.slack or first + spec.window
end

-- Writes a plain rule's new state at once, with its expiry. It writes the SET itself rather than
-- through set_string_state, and is inlined where it is called: a Lua call costs about 600
-- instructions, and the plain paths write every user's key through here.
--@inline
local function set_plain_state(spec, kind, key, first, second)
  local expires_at = plain_expires_at(spec, kind, first, second)
  local expiry = shared_text(expires_at)
  redis_call('SET', key, format(STATE_FORMAT[kind], first, second), 'PXAT', expiry)
end

-- Writes a tb, fw or sc state as the hash of earlier versions, replacing whatever the key held
-- (a string), and its expiry.
local function write_hash(kind, key, outcome)
  redis_call('DEL', key)
  if kind == 'fw' then
    redis_call('HSET', key, 'w', text(outcome.window_start), 'n', text(outcome.count))
  elseif kind == 'tb' then
    redis_call('HSET', key, 'tk', text(outcome.remaining), 'ts', text(outcome.updated_at))
  else
    redis_call('HSET', key, 'w', text(outcome.window_start), 'cur', text(outcome.count), 'prev', text(outcome.prev))
  end
  redis_call('PEXPIREAT', key, text(outcome.expires_at))
end

-- Performs an admitting outcome's write to `key`: tb, fw and sc state as hashes when `hashes`.
local function write(spec, key, outcome, now, decision_id, hashes)
  local kind = spec.kind
  if hashes and (kind == 'fw' or kind == 'tb' or kind == 'sc') then
    return write_hash(kind, key, outcome)
  end
  -- The whole state and its expiry in one SET (which also replaces an earlier version's hash).
  if kind == 'fw' then
    set_string_state(kind, key, outcome.window_start, outcome.count, outcome.expires_at)
  elseif kind == 'tb' then
    set_string_state(kind, key, outcome.remaining, outcome.updated_at, outcome.expires_at)
  elseif kind == 'gcra' then
    local tat = text(outcome.new_tat)
    redis_call('SET', key, tat, 'PXAT', tat)
  elseif kind == 'sc' then
    local start = shared_text(outcome.window_start)
    local state = 's' .. start .. ' ' .. text(outcome.count) .. ' ' .. text(outcome.prev)
    local expiry = shared_text(outcome.expires_at)
    redis_call('SET', key, state, 'PXAT', expiry)
  else
    -- Trim the entries that have left the window, so the set holds at most `limit` members. The
    -- key lives until its newest entry leaves the window; after a clock step back that entry can
    -- be later than now (as the core does).
    local newest = redis_call('ZRANGE', key, -1, -1, 'WITHSCORES')
    local newest_at = max(to_number(newest[2]) or now, now)
    redis_call('ZREMRANGEBYSCORE', key, '-inf', text(now - spec.window))
    redis_call('ZADD', key, text(now), decision_id)
    redis_call('PEXPIREAT', key, text(newest_at + spec.window))
  end
end

-- The commonest shapes ---------------------------------------------------------------------------

-- Each rule's parsed arguments and outcome during one request's decision (indices 1 to n).
local SPECS, OUTCOMES = {}, {}
-- A coalesced call's request as a lone call's keys and arguments (reused: one request at a time).
local REQUEST_KEYS, REQUEST_ARGS = {}, {}

-- The reply's first five fields of an admission every rule made, and of a replay.
local ADMITTED, REPLAYED = '1 0 0 0 0', '1 0 0 1 0'

-- The plain paths' whole replies for n rules, as string.format patterns: an admission's (the n
-- remaining values) and a denial's (denied_by, retry, then the n values). One call of
-- string.format makes the reply, where a field at a time made a string per field; it ignores
-- arguments past its pattern's, so a caller passes eight values whatever n is.
local ADMITTED_FORMAT, DENIED_FORMAT = {}, {}
do
  local admitted, denied = ADMITTED, '0 %d %d 0 0'
  for n = 1, MAX_RULES do
    admitted, denied = admitted .. ' %d', denied .. ' %d'
    ADMITTED_FORMAT[n], DENIED_FORMAT[n] = admitted, denied
  end
end

-- A plain request (see decide_plain) of one rule: the shape of a plain per-user limit, and most of
-- a store's decisions. It decides as decide_token_bucket and decide_fixed_window do, step for
-- step, with the state in locals instead of tables, and writes at once; decide_plain costs about
-- 5 % more for its loop, the general path about a fifth more for its bookkeeping. Returns the
-- reply, or nil when another path must decide: the key's state is carried by a coalesced call
-- (decide_plain), or is not a valid string of this algorithm (absent is valid; an earlier
-- version's hash and every fault go to the general path, which reads them again and answers as
-- it always has). Nothing is written before it returns nil.
local function decide_single(spec, key, now, batch)
  if batch and (batch.pending[key] or batch.read[key] ~= nil) then
    return nil
  end
  local stored, kind = redis_pcall('GET', key), spec.kind
  local first, second
  if stored then
    if stored.err then
      return nil
    end
    first, second = state_numbers(stored, kind)
    if first == nil then
      return nil
    end
  end
  local held, wait_ms, new_first, new_second = plain_step(spec, kind, now, first, second)
  if wait_ms then
    return format(DENIED_FORMAT[1], 1, wait_ms, held)
  end
  set_plain_state(spec, kind, key, new_first, new_second)
  if batch then
    return format(ADMITTED_FORMAT[1], held - spec.cost)
  end
  -- A lone call's admission by its one rule: what the rule has left, as an integer reply.
  return held - spec.cost
end

-- Per rule of a plain request (reused: one request at a time), what an admission writes: the
-- state's two numbers (plain_write derives the expiry from them); and per rule what it holds
-- before any debit, which it reports when the request is denied.
local PLAIN_FIRST, PLAIN_SECOND, PLAIN_HELD = {}, {}, {}
-- Per rule of a coalesced call's plain request whose key another request names too: whether its
-- state was read from the store by this request (not carried), and the numbers read (nil when the
-- key was empty).
local PLAIN_READ, PLAIN_READ_FIRST, PLAIN_READ_SECOND = {}, {}, {}
-- Per rule of a plain request, whether its key is carried through a coalesced call (another
-- request of the call names it too).
local PLAIN_SHARED = {}

-- The algorithm whose state `state` is, as read_state reads it (and as a coalesced call carries
-- it), or nil when there is none.
local function carried_kind(state)
  if type_of(state) == 'number' then
    return 'gcra'
  elseif type_of(state) ~= 'table' then
    return nil
  elseif state.tk then
    return 'tb'
  elseif state.cur then
    return 'sc'
  elseif state.n then
    return 'fw'
  end
  return nil
end

-- The numbers of `key`'s state as an earlier request of the call carried it (its pending write, or
-- what it read), after true when there is such a state and it is of this rule's algorithm (tb or
-- fw); false when there is one of another (the general path decides); nil when nothing is carried.
local function carried_state(kind, key, batch)
  local pending = batch.pending[key]
  if pending then
    if pending.spec.kind ~= kind then
      return false
    elseif kind == 'tb' then
      return true, pending.remaining, pending.updated_at
    end
    return true, pending.window_start, pending.count
  end
  local read = batch.read[key]
  if read == nil then
    return nil
  elseif read == false then
    return true
  elseif carried_kind(read) ~= kind then
    return false
  elseif kind == 'tb' then
    return true, read.tk, read.ts
  end
  return true, read.w, read.n
end

-- A denied plain request's reply: every rule reports what it holds, and nothing is written. In a
-- coalesced call what it read of a key another request names stays what later requests see
-- (nothing of it changed), so they need not read it again.
local function plain_denial(keys, key_base, specs, n, denied_by, retry, batch)
  local held = PLAIN_HELD
  local reply = format(DENIED_FORMAT[n], denied_by, retry, held[1], held[2], held[3], held[4],
    held[5], held[6], held[7], held[8])
  if batch then
    for i = 1, n do
      local key = keys[key_base + 1 + i]
      if PLAIN_SHARED[i] and PLAIN_READ[i] then
        local first, second = PLAIN_READ_FIRST[i], PLAIN_READ_SECOND[i]
        if first == nil then
          batch.read[key] = false
        elseif specs[i].kind == 'tb' then
          batch.read[key] = { tk = first, ts = second }
        else
          batch.read[key] = { w = first, n = second }
        end
      end
    end
  end
  return reply
end

-- An admitted plain request's write of rule `spec`'s new state (`first` and `second` as the
-- string holds them) with its expiry. A key another request of a coalesced call names too (the
-- caller passes the call's `batch` for it) is written once at the call's end, and until then
-- later requests read it from `batch`; any other key at once, as a lone call writes it.
local function plain_write(spec, key, first, second, batch)
  local kind = spec.kind
  if batch then
    -- The expiry, kept for the write at the call's end.
    local expires_at = plain_expires_at(spec, kind, first, second)
    local pending = batch.pending[key]
    if pending == nil then
      pending = { write = true }
      batch.pending[key] = pending
      batch.order[#batch.order + 1] = key
    end
    -- Written as a string: the latest admitting request's layout, as in the general path.
    pending.spec, pending.expires_at, pending.hashes = spec, expires_at, nil
    if kind == 'tb' then
      pending.remaining, pending.updated_at = first, second
    else
      pending.window_start, pending.count = first, second
    end
  else
    set_plain_state(spec, kind, key, first, second)
  end
end

-- A request whose every rule is a token bucket or a fixed window, with no decision record, dry
-- run, advisory rule or hash layout (header.plain): a plain per-user limit, or a user's and its
-- tenant's, and most of a store's decisions. It decides as decide_token_bucket and
-- decide_fixed_window do, step for step, with the numbers in locals and the library's own arrays
-- instead of a table per state and per outcome (the general path costs a fifth to a third more).
-- `specs` are the request's parsed rules, every one valid and plain (plain_specs). Returns the
-- reply, or nil when the general path must decide (a state that is not a valid string of the
-- rule's algorithm, or one carried for another algorithm): nothing is written or carried before it
-- returns nil.
local function decide_plain(keys, key_base, specs, n, now, batch)
  local firsts, seconds, held, shared = PLAIN_FIRST, PLAIN_SECOND, PLAIN_HELD, PLAIN_SHARED
  local shared_keys = batch and batch.shared
  local denied_by, retry = 0, 0
  for i = 1, n do
    local spec = specs[i]
    local key, kind = keys[key_base + 1 + i], spec.kind
    -- A boolean, never nil: the arrays keep no holes.
    local is_shared = shared_keys ~= nil and shared_keys[key] == true
    shared[i] = is_shared
    local carried, first, second
    if is_shared then
      carried, first, second = carried_state(kind, key, batch)
      if carried == false then
        return nil
      end
      PLAIN_READ[i] = carried == nil
    end
    if not carried then
      -- One GET, which must find nothing or a valid string of this algorithm: an earlier
      -- version's hash and every fault go to the general path, which reads them again and
      -- answers as it always has.
      local stored = redis_pcall('GET', key)
      if stored then
        -- A string's fields are the string library's (stored.err is nil); only an error reply
        -- has one.
        if stored.err then
          return nil
        end
        first, second = state_numbers(stored, kind)
        if first == nil then
          return nil
        end
      end
      if is_shared then
        PLAIN_READ_FIRST[i], PLAIN_READ_SECOND[i] = first, second
      end
    end
    -- The rule's decision: what it holds before any debit (reported when the request is denied),
    -- and either its wait or what its admission writes.
    local rule_held, wait_ms, new_first, new_second = plain_step(spec, kind, now, first, second)
    held[i] = rule_held
    if not wait_ms then
      firsts[i], seconds[i] = new_first, new_second
    end
    if wait_ms then
      if denied_by == 0 then denied_by = i end
      -- The hint is the maximum over denying rules; never (-1) dominates every wait.
      if retry ~= -1 and (wait_ms == -1 or wait_ms > retry) then
        retry = wait_ms
      end
    end
  end
  if denied_by ~= 0 then
    return plain_denial(keys, key_base, specs, n, denied_by, retry, batch)
  end
  -- Admitted by every rule: each reports what is left after its debit (in `held`, whose values
  -- before the debit a denial would have reported), and writes.
  for i = 1, n do
    local spec, first, second = specs[i], firsts[i], seconds[i]
    held[i] = held[i] - spec.cost
    plain_write(spec, keys[key_base + 1 + i], first, second, shared[i] and batch)
  end
  return format(ADMITTED_FORMAT[n], held[1], held[2], held[3], held[4], held[5], held[6],
    held[7], held[8])
end

-- The `n` rules whose texts follow texts[offset], parsed, when every one is valid and plain (a
-- token bucket or a fixed window): the array `into`, filled; else nil.
local function plain_specs(texts, offset, n, into)
  for i = 1, n do
    local entry = parsed(texts[offset + i], parse_rule)
    local spec = entry.ok
    if not (spec and spec.plain) then
      return nil
    end
    into[i] = spec
  end
  return into
end

-- A rule key that the request whose keys follow keys[key_base + 1] names twice, or nil. At most 8
-- keys: compared pairwise, nothing allocated.
local function repeated_key(keys, key_base, n)
  if n == 2 then
    local second = keys[key_base + 3]
    return keys[key_base + 2] == second and second or nil
  end
  for k = key_base + 3, key_base + n + 1 do
    for j = key_base + 2, k - 1 do
      if keys[j] == keys[k] then
        return keys[k]
      end
    end
  end
  return nil
end

-- The decision ---------------------------------------------------------------------------------

-- The state after an admitting outcome's write, as read_state would read it back.
local function state_after(spec, outcome)
  local kind = spec.kind
  if kind == 'tb' then
    return { tk = outcome.remaining, ts = outcome.updated_at }
  elseif kind == 'fw' then
    return { w = outcome.window_start, n = outcome.count }
  elseif kind == 'sc' then
    return { w = outcome.window_start, cur = outcome.count, prev = outcome.prev }
  end
  return outcome.new_tat
end

-- One request, whose keys start after keys[key_base], with its header in args[1] and its rules
-- after args[rules_at], and its decision id (nil when none was sent: then it may keep no record
-- and have no sliding log), at `now` (the server's clock, read by the caller) unless its header
-- names a test clock. `batch`
-- is nil for a lone call; in a coalesced call it holds, by key, the state earlier requests of the
-- call left (read once, then carried) and the writes they made, performed once at the call's end
-- (a sliding log, whose reads need its set, is written at once): `read` holds each key's state
-- as read (false when absent), `pending` its latest admitting outcome, `order` the keys to write.
-- Returns the reply, or an error reply (then nothing of this request was written or carried).
local function decide_request(keys, key_base, args, rules_at, decision_id, now, batch)
  local header_entry = parsed(args[1], parse_header)
  if header_entry.err then
    return arg_error(header_entry.err)
  end
  local header = header_entry.ok
  local n = header.n
  if decision_id ~= nil and (#decision_id == 0 or #decision_id > MAX_DECISION_ID_BYTES) then
    return arg_error('decision id must be 1 to ' .. MAX_DECISION_ID_BYTES .. ' bytes')
  end
  local record_key = keys[key_base + 1]
  local repeated = n > 1 and repeated_key(keys, key_base, n)
  if repeated then
    return arg_error('rule key ' .. repeated .. ' appears twice')
  end
  if not header.server_time then
    now = header.now
  end
  local record_ttl_ms = header.record_ttl_ms
  if record_ttl_ms > 0 and decision_id == nil then
    return arg_error('a decision record needs its key and the decision id')
  end
  -- The plain shape on its own paths; whatever they leave, the general path below decides.
  if header.plain then
    local reply
    if n == 1 then
      local entry = parsed(args[rules_at + 1], parse_rule)
      local spec = entry.ok
      reply = spec and spec.plain and decide_single(spec, keys[key_base + 2], now, batch)
    end
    local plain = not reply and plain_specs(args, rules_at, n, SPECS)
    reply = reply or plain and decide_plain(keys, key_base, plain, n, now, batch)
    if reply then
      return reply
    end
  end

  -- Replay.
  if record_ttl_ms > 0 then
    local record = redis_pcall('GET', record_key)
    if record and record.err then
      return state_error('decision record', 'the key is not a string')
    end
    if record then
      local recorded = {}
      for field in gmatch(record, '%S+') do
        if integer(field, 0, MAX_STORED) == nil then
          return state_error('decision record', 'corrupt value')
        end
        recorded[#recorded + 1] = field
      end
      if #recorded < 1 or #recorded > MAX_RULES then
        return state_error('decision record', 'corrupt value')
      end
      return REPLAYED .. ' ' .. concat(recorded, ' ')
    end
  end

  -- Rule by rule in evaluation order, like the pure core: the parameters, then the stored state's
  -- shape, then the decision. Every error returns before anything is written.
  -- The library's own arrays, reused: requests are decided one at a time, each to its end.
  local specs, outcomes = SPECS, OUTCOMES
  for i = 1, n do
    local entry = parsed(args[rules_at + i], parse_rule)
    if entry.err then
      return arg_error('rule ' .. i .. ' ' .. entry.err)
    end
    local spec = entry.ok
    if spec.kind == 'sl' and decision_id == nil then
      return arg_error('rule ' .. i .. ' is a sliding log, which needs the decision id')
    end
    local key = keys[key_base + 1 + i]
    local state, problem
    local carries = batch and spec.kind ~= 'sl'
    local pending = batch and batch.pending[key]
    -- A state carried for another algorithm is refused, as a lone call refuses the string or
    -- the sorted set it then finds (nothing of this request is written).
    local held_kind = pending and pending.spec.kind or carries and carried_kind(batch.read[key])
    if held_kind and held_kind ~= spec.kind then
      return another_algorithm(i, held_kind)
    end
    if pending then
      state = state_after(pending.spec, pending)
    elseif carries and batch.read[key] ~= nil then
      state = batch.read[key] or nil
    else
      state, problem = read_state(i, spec, key, now, decision_id)
      if problem then return problem end
      if carries then
        batch.read[key] = state or false
      end
    end
    if spec.cost_err then
      return arg_error('rule ' .. i .. ' ' .. spec.cost_err)
    end
    specs[i] = spec
    outcomes[i] = DECIDE[spec.kind](spec, state, now, key)
  end

  local denied_by, retry, advisory_denied = 0, 0, 0
  for i = 1, n do
    local outcome = outcomes[i]
    if not outcome.allowed and header.advisory[i] then
      advisory_denied = advisory_denied + 2 ^ (i - 1)
    elseif not outcome.allowed then
      if denied_by == 0 then denied_by = i end
      -- The hint is the maximum over denying rules; never (-1) dominates every wait.
      if retry ~= -1 and (outcome.retry == -1 or outcome.retry > retry) then
        retry = outcome.retry
      end
    end
  end

  -- Per rule, what is left, as the reply's tail: " remaining_1 ... remaining_n".
  local remaining = ''
  for i = 1, n do
    local outcome = outcomes[i]
    -- When another rule denied, an admitting rule reports what it holds, undebited.
    local report_available = denied_by ~= 0 and outcome.allowed
    remaining = remaining .. ' ' .. text(report_available and outcome.available or outcome.remaining)
  end

  if denied_by == 0 and not header.dry_run then
    for i = 1, n do
      local outcome, key = outcomes[i], keys[key_base + 1 + i]
      if outcome.write then
        if batch and specs[i].kind ~= 'sl' then
          if batch.pending[key] == nil then
            batch.order[#batch.order + 1] = key
          end
          -- Written once at the call's end. Until then a later request of the call reads the
          -- state this write leaves.
          outcome.spec = specs[i]
          if header.hashes then
            outcome.hashes = true
          end
          batch.pending[key] = outcome
        else
          write(specs[i], key, outcome, now, decision_id, header.hashes)
        end
      end
    end
    if record_ttl_ms > 0 then
      local expiry = shared_text(now + record_ttl_ms)
      redis_call('SET', record_key, sub(remaining, 2), 'PXAT', expiry)
    end
  end
  if denied_by == 0 and advisory_denied == 0 then
    return ADMITTED .. remaining
  end
  local verdict = format('%d %d %d 0 %d', denied_by == 0 and 1 or 0, denied_by, retry, advisory_denied)
  return verdict .. remaining
end

-- The server's clock, ms.
--@inline
local function server_now()
  local time = redis_call('TIME')
  -- Seconds and microseconds, as digit strings: arithmetic coerces them exactly.
  local micros = time[2]
  return time[1] * 1000 + (micros - micros % 1000) / 1000
end

-- A lone request: KEYS and ARGV as the header comment says.
local function decide(keys, args)
  if not format then
    bind_library()
  end
  local header_entry = parsed(args[1], parse_header)
  if header_entry.err then
    return arg_error(header_entry.err)
  end
  local n = header_entry.ok.n
  local key_count, arg_count = #keys, #args
  local key_base, rules_at, decision_id
  if key_count == n + 1 and arg_count == 2 + n then
    key_base, rules_at, decision_id = 0, 2, args[2]
  elseif key_count == n and arg_count == 1 + n then
    -- Without the decision record's key and the decision id.
    key_base, rules_at = -1, 1
  else
    return arg_error('expected ' .. (n + 1) .. ' keys and ' .. (2 + n) .. ' arguments, or ' .. n
      .. ' and ' .. (1 + n) .. ' without a decision record or id')
  end
  local now = 0
  if header_entry.ok.server_time then
    now = server_now()
  end
  return decide_request(keys, key_base, args, rules_at, decision_id, now, nil)
end

-- Most requests one coalesced call decides, and most distinct texts (headers and rules) it sends.
local MAX_REQUESTS = 64
local MAX_TEXTS = MAX_REQUESTS * (1 + MAX_RULES)
-- Most keys a coalesced call names (each request's record and rule keys), and the longest layout:
-- 3 + 2 x 8 fields of at most 3 characters, one space apart, well within it.
local MAX_CALL_KEYS = MAX_REQUESTS * (1 + MAX_RULES)
local MAX_LAYOUT_BYTES = 96

-- The call (a serial) each key was last sent in, for the check that a call sends each key once:
-- kept across calls, so that a key a tenant's calls send again costs an update where a table per
-- call cost an insert (about 1,400 instructions per decision of a hot tenant's call of 16). Emptied
-- when the next call would take it past MAX_KEY_CALLS keys (so it holds at most that many, or one
-- call's keys): small, because every key it keeps is work for each of Lua's collections, which
-- every decision pays for (kept to 4,096 keys, it cost a lone decision about 5,000 instructions).
local MAX_KEY_CALLS = 256
local key_calls, key_calls_count, call_serial = {}, 0, 0

-- A key slot of a layout: 0 for the call's next key not yet taken, j for KEYS[j], false for none
-- ('-'), or nil.
local function key_slot(field)
  if field == 'n' then
    return 0
  elseif field == '-' then
    return false
  end
  return integer(field, 1, MAX_CALL_KEYS)
end

-- A request's layout in a coalesced call (see decide_many) as {ok = its structure} or {err = why
-- not}: the text indices of its header and rules, its rule count, whether its decision id
-- follows, and per key slot (its decision record's, then one per rule) what key_slot answers;
-- `fresh` counts the slots that take a new key, `latest` is the highest KEYS index the others
-- name, `shared` lists those indices for rule keys, and `repeats` is true when two rules name the
-- same index (the request names a key twice: refused, as a lone call is). The structure names
-- texts by index only, so the same layout in the next call is the same structure: it is parsed
-- once (`parsed`), and checked against each call's texts (layout_in_call).
local function parse_layout(layout)
  if #layout > MAX_LAYOUT_BYTES then
    return { err = 'a layout must be at most ' .. MAX_LAYOUT_BYTES .. ' bytes' }
  end
  local parts = {}
  for part in gmatch(layout, '%S+') do
    parts[#parts + 1] = part
  end
  local count = #parts
  if count < 5 or count % 2 == 0 or count > 3 + 2 * MAX_RULES or concat(parts, ' ') ~= layout then
    return { err = 'a layout must be a header, an id flag, a record slot and 1 to ' .. MAX_RULES
      .. ' rules with their key slots, one space apart' }
  end
  if parts[2] ~= 'i' and parts[2] ~= '-' then
    return { err = 'the id flag must be i or -' }
  end
  local structure = { header = integer(parts[1], 1, MAX_TEXTS), id = parts[2] == 'i',
    n = (count - 3) / 2, rules = {}, slots = {}, fresh = 0, latest = 0, shared = {},
    repeats = false }
  if structure.header == nil then
    return { err = 'the header must be a text index' }
  end
  for s = 1, structure.n + 1 do
    local slot = key_slot(parts[2 * s + 1])
    if slot == nil or (s > 1 and slot == false) then
      return { err = 'a key slot must be n or a key index (or - for the record)' }
    end
    structure.slots[s] = slot
    if slot == 0 then
      structure.fresh = structure.fresh + 1
    elseif slot then
      if slot > structure.latest then
        structure.latest = slot
      end
      if s > 1 then
        for k = 1, #structure.shared do
          structure.repeats = structure.repeats or structure.shared[k] == slot
        end
        structure.shared[#structure.shared + 1] = slot
      end
    end
    if s > 1 then
      structure.rules[s - 1] = integer(parts[2 * s], 1, MAX_TEXTS)
      if structure.rules[s - 1] == nil then
        return { err = 'rule ' .. (s - 1) .. ' must be a text index' }
      end
    end
  end
  return { ok = structure }
end

-- What `layout` (a structure) means with this call's `text_count` texts (ARGV[3 ..]) and server
-- clock `now`: {header = its text, rules = its rules' texts, now = the clock its requests are
-- decided at, specs = its parsed rules when the request is plain (decide_plain), else nil}, kept
-- on the structure for the next call with the same texts; or nil and why it does not fit:
-- every index must name a text, the header must count the layout's rules, a request without a
-- record slot must keep no record, and one without its decision id must have neither a record nor
-- a sliding log.
local function layout_in_call(layout, args, text_count, now)
  if layout.header > text_count then
    return nil, 'the header names no text'
  end
  local header_text = args[2 + layout.header]
  -- The same texts as the call before (the common case: a tenant's calls repeat their rules)
  -- mean the same thing; only the clock moves.
  local last = layout.last_meaning
  if last and last.header == header_text then
    local same = true
    for i = 1, layout.n do
      local t = layout.rules[i]
      same = same and t <= text_count and args[2 + t] == last.rules[i]
    end
    if same then
      last.now = last.server_time and now or last.now
      return last
    end
  end
  local header_entry = parsed(header_text, parse_header)
  if header_entry.err then
    return nil, header_entry.err
  end
  local header = header_entry.ok
  if header.n ~= layout.n then
    return nil, 'the header counts ' .. header.n .. ' rules, the layout ' .. layout.n
  end
  local keeps_record = header.record_ttl_ms > 0
  if keeps_record and layout.slots[1] == false then
    return nil, 'a request that keeps a decision record needs its record key'
  end
  local needs_id, rules = keeps_record, {}
  for i = 1, layout.n do
    if layout.rules[i] > text_count then
      return nil, 'rule ' .. i .. ' names no text'
    end
    rules[i] = args[2 + layout.rules[i]]
    needs_id = needs_id or sub(rules[i], 1, 3) == 'sl '
  end
  if needs_id and not layout.id then
    return nil, 'a sliding log or a decision record needs the decision id'
  end
  local meaning = {
    header = header_text,
    rules = rules,
    server_time = header.server_time,
    now = header.server_time and now or header.now,
    specs = header.plain and plain_specs(rules, 0, layout.n, {}) or nil,
  }
  layout.last_meaning = meaning
  return meaning
end

-- One request of a coalesced call, its keys taken from KEYS after `taken` as its layout's slots
-- say, decided as a lone call would be with the state earlier requests left in `batch`: its reply,
-- and the keys taken after it. `decision_id` is nil when the call sends none for it. `general`
-- sends it straight to the general path (the plain paths found a state they do not decide: trying
-- them again would read its keys again for nothing).
local function decide_taken(keys, taken, layout, meaning, decision_id, now, batch, general)
  local request_keys, n, slots = REQUEST_KEYS, layout.n, layout.slots
  for s = 1, n + 1 do
    local j = slots[s]
    if j == 0 then
      taken = taken + 1
      j = taken
    end
    request_keys[s] = j and keys[j]
  end
  -- A plain request on the plain paths (their replies are strings); whatever they leave, and every
  -- other request, as a lone call's arguments on the general path.
  local reply
  local specs = not general and meaning.specs
  local id_fits = decision_id == nil or (#decision_id > 0 and #decision_id <= MAX_DECISION_ID_BYTES)
  if specs and id_fits and not (n > 1 and repeated_key(request_keys, 0, n)) then
    local at = meaning.now
    reply = n == 1 and decide_single(specs[1], request_keys[2], at, batch)
      or decide_plain(request_keys, 0, specs, n, at, batch)
  end
  if not reply then
    local request_args = REQUEST_ARGS
    request_args[1], request_args[2] = meaning.header, decision_id
    for i = 1, n do
      request_args[2 + i] = meaning.rules[i]
    end
    reply = decide_request(request_keys, 0, request_args, 2, decision_id, now, batch)
    -- A refused request's error goes back as its text, not as an error reply: clients may take an
    -- error anywhere in a reply for the whole reply's. (A string's `err` is nil.)
    reply = reply.err or reply
  end
  return reply, taken
end

-- Per rule of a plain run: its key when every request of the run names the same one (a KEYS
-- index, taken by an earlier run), else false; for such a key, whether the run holds its state,
-- and the state's two numbers (nil when empty). Per rule whose key each request takes afresh,
-- this request's key.
local RUN_KEY, RUN_LOADED, RUN_FIRST, RUN_SECOND, RUN_FRESH_KEY = {}, {}, {}, {}, {}
-- Per rule whose key each request takes afresh: whether this request's key goes through `batch`
-- (a later request names it too).
local RUN_FRESH_CARRIED = {}
-- The keys of a run that MGET answered nil for (reused).
local RUN_NILS = {}

-- Hands the state of the run's keys to `batch` after an admission changed them (written at the
-- call's end, read by later requests), as decide_plain's admissions do.
local function run_to_batch(specs, n, batch)
  for i = 1, n do
    local key = RUN_KEY[i]
    if key then
      plain_write(specs[i], key, RUN_FIRST[i], RUN_SECOND[i], batch)
    end
  end
end

-- The state of run key `key` for a rule of `kind` from what earlier requests carried, else from
-- one GET (then kept in `batch` as read at once: nothing of the call writes the key before the
-- call's end, so later requests may read it there whatever this one decides): true and its two
-- numbers, or false when another path must decide (decide_plain returns nil for the same states).
local function run_state(kind, key, batch)
  local carried, first, second = carried_state(kind, key, batch)
  if carried ~= nil then
    return carried, first, second
  end
  local stored = redis_pcall('GET', key)
  if stored then
    if stored.err then
      return false
    end
    first, second = state_numbers(stored, kind)
    if first == nil then
      return false
    end
    batch.read[key] = kind == 'tb' and { tk = first, ts = second } or { w = first, n = second }
  else
    batch.read[key] = false
  end
  return true, first, second
end

-- Whether every key MGET answered nil for (`values`, of keys[after + 1 ..]) is empty: one EXISTS
-- over them (none when every value was a string).
local function run_keys_absent(keys, after, values)
  local nils, count = RUN_NILS, 0
  for k = 1, #values do
    if not values[k] then
      count = count + 1
      nils[count] = keys[after + k]
    end
  end
  return count == 0 or redis_call('EXISTS', unpack_values(nils, 1, count)) == 0
end

-- A run of plain requests (decide_plain's shape) whose rules name no key twice, decided as
-- decide_plain decides each, in order: the replies go to replies[decided + 1 ..]. Returns the keys
-- taken and the requests decided after the run. What makes it cheaper than a request at a time:
-- a key every request of the run names (a tenant's) is read once and carried in the run's own
-- arrays, handed to `batch` only when the run ends or falls back; the keys each request takes for
-- itself (a user's) are read in one MGET and written at once, with no bookkeeping; and a key a later request names too (a tenant's, taken
-- by the call's first request) goes through `batch` as decide_plain carries it. A request whose
-- state decide_plain would not decide (a state of another algorithm, an earlier version's hash, a
-- fault) goes to decide_taken, with the run's state handed over first.
local function decide_plain_run(keys, taken, run, layout, meaning, now, batch, replies, decided)
  local specs, n, slots, at = meaning.specs, layout.n, layout.slots, meaning.now
  local shared_keys, record_taken = batch.shared, slots[1] == 0
  local run_key, loaded, run_first, run_second, fresh_key, fresh_carried =
    RUN_KEY, RUN_LOADED, RUN_FIRST, RUN_SECOND, RUN_FRESH_KEY, RUN_FRESH_CARRIED
  local firsts, seconds, held = PLAIN_FIRST, PLAIN_SECOND, PLAIN_HELD
  -- Whether a request of the run was admitted since the run's state last went to `batch`: an
  -- admission changes every run key's state.
  local changed = false
  for i = 1, n do
    local j = slots[i + 1]
    run_key[i], loaded[i] = j ~= 0 and keys[j], false
  end
  -- The keys the run's requests take, read in one MGET: each GET is a command, and a command a
  -- library runs costs Redis about 4,000 instructions besides its own work. No write of the call
  -- touches them before their requests decide: each is named by its request alone (a key another
  -- request names goes through `batch`, and the call sends every key once). MGET answers nil for
  -- an empty key and for one that is not a string alike; one EXISTS over the nils tells them apart
  -- when it counts none, else each nil is read again with a GET.
  local prefetched, prefetched_after, all_absent = nil, taken, false
  if run > 1 and layout.fresh > 0 then
    prefetched = redis_call('MGET', unpack_values(keys, taken + 1, taken + run * layout.fresh))
    all_absent = run_keys_absent(keys, taken, prefetched)
  end
  for _ = 1, run do
    local taken_before, reply = taken, nil
    if record_taken then
      taken = taken + 1
    end
    local denied_by, retry, fits = 0, 0, true
    for i = 1, n do
      local spec, key, first, second = specs[i], run_key[i], nil, nil
      local kind = spec.kind
      if key then
        if not loaded[i] then
          fits, first, second = run_state(kind, key, batch)
          if not fits then
            break
          end
          loaded[i], run_first[i], run_second[i] = true, first, second
        end
        first, second = run_first[i], run_second[i]
      else
        taken = taken + 1
        key = keys[taken]
        fresh_key[i] = key
        -- A key a later request names too (a tenant's, in a call's first request): its state
        -- goes through `batch`, as decide_plain carries it.
        local carried = shared_keys[key] == true
        fresh_carried[i] = carried
        if carried then
          fits, first, second = run_state(kind, key, batch)
          if not fits then
            break
          end
        else
          local stored = prefetched and prefetched[taken - prefetched_after]
          if not stored and not all_absent then
            -- Not read with the run, or read as nil (empty, or not a string).
            stored = redis_pcall('GET', key)
            if stored and stored.err then
              fits = false
              break
            end
          end
          if stored then
            first, second = state_numbers(stored, kind)
            if first == nil then
              fits = false
              break
            end
          end
        end
      end
      -- The rule's decision, as decide_plain makes it.
      local rule_held, wait_ms, new_first, new_second = plain_step(spec, kind, at, first, second)
      held[i] = rule_held
      if not wait_ms then
        firsts[i], seconds[i] = new_first, new_second
      end
      if wait_ms then
        if denied_by == 0 then denied_by = i end
        -- The hint is the maximum over denying rules; never (-1) dominates every wait.
        if retry ~= -1 and (wait_ms == -1 or wait_ms > retry) then
          retry = wait_ms
        end
      end
    end
    if not fits then
      if changed then
        run_to_batch(specs, n, batch)
        changed = false
      end
      reply, taken = decide_taken(keys, taken_before, layout, meaning, nil, now, batch, true)
      -- The request may have changed what the run holds.
      for i = 1, n do
        loaded[i] = false
      end
    elseif denied_by ~= 0 then
      reply = format(DENIED_FORMAT[n], denied_by, retry, unpack_values(held, 1, n))
    else
      -- Admitted by every rule: a run key's new state stays in the run, a request's own key is
      -- written at once.
      for i = 1, n do
        local spec, first, second = specs[i], firsts[i], seconds[i]
        held[i] = held[i] - spec.cost
        if run_key[i] then
          run_first[i], run_second[i] = first, second
        else
          local key = fresh_key[i]
          if fresh_carried[i] then
            plain_write(spec, key, first, second, batch)
          else
            -- plain_write's write at once, without its call.
            set_plain_state(spec, spec.kind, key, first, second)
          end
        end
      end
      changed = true
      reply = format(ADMITTED_FORMAT[n], unpack_values(held, 1, n))
    end
    decided = decided + 1
    replies[decided] = reply
  end
  if changed then
    run_to_batch(specs, n, batch)
  end
  return taken, decided
end

-- Several requests of one tenant (one slot), decided one after another in the order given, each
-- all or nothing and each with its own reply, exactly as that many lone calls in a row at one
-- instant would decide them. What the requests have in common is sent once: every key once in
-- KEYS, every header and rule text once in ARGV, and a layout once for a run of requests that
-- share it.
--
-- KEYS     the call's keys, each once (a call that sends one twice is refused whole), in the
--          order the requests first name them.
-- ARGV[1]  the request count R, 1 to 64.
-- ARGV[2]  the text count T; ARGV[3 .. 2 + T] the texts, each a header or a rule as a lone call
--          sends it.
-- Then the requests in order, in runs: a run is the count of its requests, their layout, and
-- (when the layout says so) each one's decision id. A layout is "<header> <id> <record> <rule_1>
-- <key_1> ... <rule_n> <key_n>", one space apart, where <header> and each <rule_i> are text
-- indices (1 to T), <id> is `i` when the run's decision ids follow and `-` when it sends none
-- (allowed when its requests have no sliding log and keep no decision record), and each key slot
-- is `n` (the next key of KEYS not taken yet: keys are taken in order, a request's slots in
-- order), an index j of KEYS taken by a request of an earlier run, or, for <record> of a request
-- that keeps no record, `-`.
--
-- Replies {reply_1, ..., reply_R}: each a lone call's reply (a string of digits), or, for a
-- request refused for its rules, decision id or state (the others are decided all the same), the
-- text of the error reply a lone call would have given (it starts with a letter). The reply as a
-- whole is an error when the call's layout is wrong (the counts, a run, a layout, a header, a key
-- sent twice, or keys and arguments that do not add up): then nothing ran.
local function decide_many(keys, args)
  if not format then
    bind_library()
  end
  local count = integer(args[1], 1, MAX_REQUESTS)
  if count == nil then
    return arg_error('the request count must be 1 to ' .. MAX_REQUESTS)
  end
  local text_count = integer(args[2], 1, MAX_TEXTS)
  if text_count == nil or 2 + text_count > #args then
    return arg_error('the text count must be 1 to ' .. MAX_TEXTS .. ', within the arguments')
  end
  local now = server_now()
  -- Every run first, so that nothing is decided for a call that is cut short. Each distinct
  -- layout is parsed once (and kept for later calls) and read against the call's texts once.
  local in_call, shared_keys, run_layouts = {}, {}, {}
  local arg, taken, decided = 3 + text_count, 0, 0
  local key_count, arg_count = #keys, #args
  while decided < count do
    local run = integer(args[arg], 1, count - decided)
    local layout_text = args[arg + 1]
    if run == nil or layout_text == nil then
      return arg_error('request ' .. (decided + 1) .. ': a run must be its count (within the requests) and a layout')
    end
    local entry = parsed(layout_text, parse_layout)
    if entry.err then
      return arg_error('request ' .. (decided + 1) .. ': ' .. entry.err)
    end
    local layout = entry.ok
    run_layouts[#run_layouts + 1] = layout
    if in_call[layout] == nil then
      local meaning, problem = layout_in_call(layout, args, text_count, now)
      if meaning == nil then
        return arg_error('request ' .. (decided + 1) .. ': ' .. problem)
      end
      in_call[layout] = meaning
      -- Keys another request names too: their state is carried through the call (decide_plain).
      for k = 1, #layout.shared do
        local key = keys[layout.shared[k]]
        if key then
          shared_keys[key] = true
        end
      end
    end
    if layout.latest > taken then
      return arg_error('request ' .. (decided + 1) .. ': a key slot names a key no earlier run took')
    end
    taken, decided = taken + run * layout.fresh, decided + run
    arg = arg + 2 + (layout.id and run or 0)
    if taken > key_count or arg > arg_count + 1 then
      return arg_error('request ' .. decided .. ' runs past the keys or arguments')
    end
  end
  if taken ~= key_count or arg ~= arg_count + 1 then
    return arg_error('expected ' .. taken .. ' keys and ' .. (arg - 1) .. ' arguments')
  end
  -- Every key once: only a key named again by its index is carried through the call (`shared`);
  -- one sent twice would be read from the store while a write to it waited for the call's end.
  if key_calls_count + key_count > MAX_KEY_CALLS then
    key_calls, key_calls_count = {}, 0
  end
  call_serial = call_serial + 1
  for k = 1, key_count do
    local key = keys[k]
    local last = key_calls[key]
    if last == call_serial then
      return arg_error('KEYS[' .. k .. '] repeats an earlier key: a call sends each key once')
    elseif last == nil then
      key_calls_count = key_calls_count + 1
    end
    key_calls[key] = call_serial
  end
  local batch = { read = {}, pending = {}, order = {}, shared = shared_keys }
  local replies = {}
  arg, taken, decided = 3 + text_count, 0, 0
  for k = 1, #run_layouts do
    local run, layout = args[arg] + 0, run_layouts[k]
    local meaning = in_call[layout]
    arg = arg + 2
    -- Plain requests of several rules as a run (a user's and its tenant's: the tenant's state
    -- read once, carried in locals); of one rule each on decide_single, which costs less per
    -- request than the run's loop. The agent sends no decision id for a plain request (it has no
    -- sliding log and keeps no record); one sent anyway is checked per request, as a lone call
    -- checks it.
    if meaning.specs and layout.n > 1 and not layout.repeats and not layout.id then
      taken, decided = decide_plain_run(keys, taken, run, layout, meaning, now, batch, replies, decided)
    else
      for _ = 1, run do
        -- nil when the run sends none: its requests have no sliding log and keep no record, the
        -- only parts of a decision that read the id.
        local decision_id
        if layout.id then
          decision_id, arg = args[arg], arg + 1
        end
        decided = decided + 1
        replies[decided], taken = decide_taken(keys, taken, layout, meaning, decision_id, now, batch)
      end
    end
  end
  local order = batch.order
  for k = 1, #order do
    local key = order[k]
    local pending = batch.pending[key]
    write(pending.spec, key, pending, nil, nil, pending.hashes)
  end
  return replies
end

redis.register_function('allot_decide_LIBRARY_VERSION', decide)
redis.register_function('allot_decide_many_LIBRARY_VERSION', decide_many)

"""Lua scripts that make every replay operation one atomic step inside Redis.

Keys of a job (prefix P = `fleetrl:replay:<job>:`):
  P..cfg      hash   capacity, sampler (its name, for ConfigureTable's answers), selection
                     (oldest|uniform|priority), drops_stale (1|0), max_reuse (1 without reuse),
                     lease_timeout_ms: the scripts follow selection, drops_stale and max_reuse; fence
                     (the newest job-lease epoch seen: ConfigureTable raises it, Commit below it is refused)
  P..ctr      hash   counters (inserted, duplicates, sampled, committed, expired_leases,
                     evicted, stale_dropped) and `seq`, the insertion sequence
  P..seen     set    every task id ever inserted: dedup holds after consumption too
  P..data     hash   task id -> serialised Group bytes (stored groups only)
  P..stored   zset   task id -> seq, every stored group (sampleable or leased)
  P..avail    zset   task id -> seq, sampleable groups (fifo order, eviction order)
  P..pv       zset   task id -> policy version, sampleable groups (staleness filter)
  P..gpv      hash   task id -> policy version, every stored group (to return leased groups)
  P..prio     hash   task id -> priority, every stored group
  P..reuse    hash   task id -> times committed (kept with the lineage)
  P..lin      hash   task id -> lineage JSON (kept after consumption, bounded)
  P..linpv    zset   task id -> policy version of each lineage record (trim oldest versions first)
  P..leases   zset   lease id -> expiry (unix ms, by Redis's clock) of open leases
  P..lease:<id> set  task ids of one open lease
  P..done     zset   lease id -> commit time (Redis's clock) of committed leases (commit twice is a no-op)

INSERT, SAMPLE and COMMIT also take KEYS[1], the job's ledger `fate` hash (`fleetrl.tasks.ledger`):
a group's arrival and its removal (consumed, stale, evicted) are recorded there in the same step.
Leased groups leave `avail`/`pv` and come back on release or expiry (Renew pushes a lease's
expiry back while its holder lives). Insert carries no `allow-oom` flag, so Redis refuses it
whole when out of memory (backpressure); Sample/Commit/Release/Renew may run out of memory
because they free it or change nothing in size. The scripts build key names from the prefix,
so the table of a job (and its ledger) must live on one Redis node.

Time: lease expiry, renewal and reclaim read Redis's clock (`TIME`, through `now_ms` in each script), never
the calling replica's. Replay replicas (the HA overlay runs three) share one Redis and so one clock: a
replica whose clock is skewed or stepped by NTP can neither expire a live lease early nor keep a dead one.
"""

from __future__ import annotations

_COMMON = r"""
local P = ARGV[1]
local F = KEYS[1]
local function now_ms()
  -- Redis's clock, the one clock every replica shares (scripts replicate their effects, so TIME is allowed)
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function delete_group(t, fate)
  redis.call('HSET', F, t, fate)
  redis.call('HDEL', P..'data', t)
  redis.call('ZREM', P..'stored', t)
  redis.call('ZREM', P..'avail', t)
  redis.call('ZREM', P..'pv', t)
  redis.call('HDEL', P..'gpv', t)
  redis.call('HDEL', P..'prio', t)
end
local function make_available(t)
  local seq = redis.call('ZSCORE', P..'stored', t)
  if seq then
    redis.call('ZADD', P..'avail', seq, t)
    redis.call('ZADD', P..'pv', redis.call('HGET', P..'gpv', t), t)
    return 1
  end
  return 0
end
local function return_lease(id)
  local n = 0
  for _, t in ipairs(redis.call('SMEMBERS', P..'lease:'..id)) do n = n + make_available(t) end
  redis.call('DEL', P..'lease:'..id)
  redis.call('ZREM', P..'leases', id)
  return n
end
local function hmget_all(key, ids)
  -- unpack() of a long list would overflow the Lua stack
  local out = {}
  for i = 1, #ids, 1000 do
    local part = redis.call('HMGET', key, unpack(ids, i, math.min(i + 999, #ids)))
    for j = 1, #part do out[#out + 1] = part[j] end
  end
  return out
end
local function reclaim(now)
  local ids = redis.call('ZRANGEBYSCORE', P..'leases', '-inf', now)
  for _, id in ipairs(ids) do return_lease(id) end
  if #ids > 0 then redis.call('HINCRBY', P..'ctr', 'expired_leases', #ids) end
  return #ids
end
"""

# KEYS: ledger fate hash; ARGV: prefix, max_lineage, then per group: task, payload, policy_version,
# priority, lineage_json
# returns {-1} no table, or {outcome per group (1 inserted | 0 duplicate)..., evicted}
INSERT = "#!lua\n" + _COMMON + r"""
if redis.call('EXISTS', P..'cfg') == 0 then return {-1} end
local max_lineage = tonumber(ARGV[2])
local capacity = tonumber(redis.call('HGET', P..'cfg', 'capacity'))
local n = (#ARGV - 2) / 5
-- one block of sequence numbers for the whole call (a duplicate leaves a gap), and the sizes
-- counted here instead of asked for per group
local seq = redis.call('HINCRBY', P..'ctr', 'seq', n) - n
local stored = redis.call('ZCARD', P..'stored')
local lineage = redis.call('ZCARD', P..'linpv')
local out = {}
local inserted, duplicates, evicted = 0, 0, 0
for i = 3, #ARGV, 5 do
  local t, pv = ARGV[i], ARGV[i + 2]
  seq = seq + 1
  if redis.call('SADD', P..'seen', t) == 0 then
    duplicates = duplicates + 1
    out[#out + 1] = 0
  else
    redis.call('HSET', F, t, 'r')
    redis.call('HSET', P..'data', t, ARGV[i + 1])
    redis.call('ZADD', P..'stored', seq, t)
    redis.call('ZADD', P..'avail', seq, t)
    redis.call('ZADD', P..'pv', pv, t)
    redis.call('HSET', P..'gpv', t, pv)
    redis.call('HSET', P..'prio', t, ARGV[i + 3])
    redis.call('HSET', P..'lin', t, ARGV[i + 4])
    lineage = lineage + redis.call('ZADD', P..'linpv', pv, t)
    if lineage > max_lineage then
      for _, old in ipairs(redis.call('ZPOPMIN', P..'linpv', lineage - max_lineage)) do
        redis.call('HDEL', P..'lin', old)
        redis.call('HDEL', P..'reuse', old)
      end
      lineage = max_lineage
    end
    inserted = inserted + 1
    stored = stored + 1
    out[#out + 1] = 1
    while stored > capacity do
      -- oldest sampleable group other than the new one; leased groups are never evicted
      local victim = nil
      for _, v in ipairs(redis.call('ZRANGE', P..'avail', 0, 1)) do
        if v ~= t and victim == nil then victim = v end
      end
      if victim == nil then break end
      delete_group(victim, 'e')
      stored = stored - 1
      evicted = evicted + 1
    end
  end
end
if inserted > 0 then redis.call('HINCRBY', P..'ctr', 'inserted', inserted) end
if duplicates > 0 then redis.call('HINCRBY', P..'ctr', 'duplicates', duplicates) end
if evicted > 0 then redis.call('HINCRBY', P..'ctr', 'evicted', evicted) end
out[#out + 1] = evicted
return out
"""

# KEYS: ledger fate hash; ARGV: prefix, max_groups, min_policy_version, seed, lease_id
# returns {-1} no table, or {stale_dropped, expires_ms, payload...}
SAMPLE = "#!lua flags=allow-oom\n" + _COMMON + r"""
local cfg = redis.call('HMGET', P..'cfg', 'selection', 'lease_timeout_ms', 'drops_stale')
if not cfg[1] then return {-1} end
local now = now_ms()
local k = tonumber(ARGV[2])
local min_pv = ARGV[3]
reclaim(now)
local stale = 0
local chosen = {}
if cfg[3] == '1' then
  local old = redis.call('ZRANGEBYSCORE', P..'pv', '-inf', '(' .. min_pv)
  for _, t in ipairs(old) do delete_group(t, 's') end
  stale = #old
  if stale > 0 then redis.call('HINCRBY', P..'ctr', 'stale_dropped', stale) end
end
if cfg[1] == 'oldest' then
  -- avail is in insertion order; with stale groups dropped above, every one of them is fresh
  chosen = redis.call('ZRANGE', P..'avail', 0, k - 1)
else
  math.randomseed(tonumber(ARGV[4]))
  local ids = redis.call('ZRANGEBYSCORE', P..'pv', min_pv, '+inf')
  if cfg[1] == 'uniform' then
    for i = 1, math.min(k, #ids) do
      local j = math.random(i, #ids)
      ids[i], ids[j] = ids[j], ids[i]
      chosen[i] = ids[i]
    end
  elseif #ids > 0 then
    -- weighted sampling without replacement (Efraimidis-Spirakis): smallest -log(u)/w
    local w = hmget_all(P..'prio', ids)
    local keyed = {}
    for i, t in ipairs(ids) do
      keyed[i] = {-math.log(1 - math.random()) / tonumber(w[i]), t}
    end
    table.sort(keyed, function(a, b) return a[1] < b[1] end)
    for i = 1, math.min(k, #keyed) do chosen[i] = keyed[i][2] end
  end
end
if #chosen == 0 then return {stale, 0} end
local expires = now + tonumber(cfg[2])
local id = ARGV[5]
for _, t in ipairs(chosen) do
  redis.call('ZREM', P..'avail', t)
  redis.call('ZREM', P..'pv', t)
end
redis.call('SADD', P..'lease:'..id, unpack(chosen))
redis.call('ZADD', P..'leases', expires, id)
redis.call('HINCRBY', P..'ctr', 'sampled', #chosen)
local out = {stale, expires}
local payloads = redis.call('HMGET', P..'data', unpack(chosen))
for i = 1, #payloads do out[i + 2] = payloads[i] end
return out
"""

# KEYS: ledger fate hash; ARGV: prefix, lease_id, lease_epoch; returns committed groups, or -1
# unknown/expired, -2 no table, -3 fenced (a newer job-lease epoch configured the table)
COMMIT = "#!lua flags=allow-oom\n" + _COMMON + r"""
local cfg = redis.call('HMGET', P..'cfg', 'max_reuse', 'fence')
if not cfg[1] then return -2 end
if tonumber(ARGV[3]) < tonumber(cfg[2] or '0') then return -3 end
local max_reuse = cfg[1]
local now = now_ms()
local id = ARGV[2]
if redis.call('ZSCORE', P..'done', id) then return 0 end
reclaim(now)
if not redis.call('ZSCORE', P..'leases', id) then return -1 end
max_reuse = tonumber(max_reuse)
local n = 0
for _, t in ipairs(redis.call('SMEMBERS', P..'lease:'..id)) do
  if redis.call('ZSCORE', P..'stored', t) then
    n = n + 1
    if redis.call('HINCRBY', P..'reuse', t, 1) >= max_reuse then delete_group(t, 'c') else make_available(t) end
  end
end
redis.call('DEL', P..'lease:'..id)
redis.call('ZREM', P..'leases', id)
redis.call('ZADD', P..'done', now, id)
redis.call('ZREMRANGEBYSCORE', P..'done', '-inf', now - 7 * 24 * 3600 * 1000)
redis.call('HINCRBY', P..'ctr', 'committed', n)
return n
"""

# ARGV: prefix, lease_id; returns released groups, -1 unknown/expired, -2 no table, -3 committed
RELEASE = "#!lua flags=allow-oom\n" + _COMMON + r"""
if redis.call('EXISTS', P..'cfg') == 0 then return -2 end
local id = ARGV[2]
if redis.call('ZSCORE', P..'done', id) then return -3 end
reclaim(now_ms())
if not redis.call('ZSCORE', P..'leases', id) then return -1 end
return return_lease(id)
"""

# ARGV: prefix, lease_id...; returns {-1} no table, or {expires_ms, lease id not open...}
RENEW = "#!lua flags=allow-oom\n" + _COMMON + r"""
local timeout = redis.call('HGET', P..'cfg', 'lease_timeout_ms')
if not timeout then return {-1} end
local now = now_ms()
reclaim(now)
local out = {now + tonumber(timeout)}
for i = 2, #ARGV do
  if redis.call('ZSCORE', P..'leases', ARGV[i]) then
    redis.call('ZADD', P..'leases', out[1], ARGV[i])
  else
    out[#out + 1] = ARGV[i]
  end
end
return out
"""

# ARGV: prefix, lease_epoch; returns the fence after the call, or -1 when lease_epoch is below it
RAISE_FENCE = "#!lua\n" + r"""
local P = ARGV[1]
local fence = tonumber(redis.call('HGET', P..'cfg', 'fence') or '0')
local epoch = tonumber(ARGV[2])
if epoch < fence then return -1 end
redis.call('HSET', P..'cfg', 'fence', epoch)
return epoch
"""

# ARGV: prefix, min_policy_version; returns {stored, sampleable, eligible, expired now} or {-1}
STATUS = "#!lua flags=allow-oom\n" + _COMMON + r"""
if redis.call('EXISTS', P..'cfg') == 0 then return {-1} end
local expired = reclaim(now_ms())
return {redis.call('ZCARD', P..'stored'), redis.call('ZCARD', P..'avail'),
        redis.call('ZCOUNT', P..'pv', ARGV[2], '+inf'), expired}
"""

"""The Redis store: every step one Lua script, judged by the server's ``TIME``.

It decides nothing (the rules are in :mod:`effectfence.protocol`): a script runs atomically
on the server, so each step of :mod:`effectfence.store.base` is one script whose conditions
are the plain comparisons the decider chose, and costs one round trip.

Keys, all under one hash tag (``{prefix}``, ``?prefix=name`` in the URL, default
``effectfence``) so a cluster keeps them in one slot::

    {p}:i:<intent>    hash: one record, codec fields; PEXPIREAT at its reclaim_at
    {p}:d:<domain>    hash: seq, head, clock (the domain's counter and head)
    {p}:domains       set: domain names (size())
    {p}:fl:<domain>   set: intents in flight on the domain (checked against the records)
    {p}:reclaim       zset: ["intent","domain"] by reclaim_at: what sweep cleans up
    {p}:c:<domain>    zset: certificate JSON by seq: the audit trail
    {p}:audit         zset: [id, at, intent, entry JSON] by id: the operator's clears
    {p}:audit_id      counter: audit entry ids (INCR)
    {p}:fence         hash: floor (where new domains start, raised by evictions: G5)
    {p}:tokens        counter: fencing tokens (INCR)
    {p}:meta          hash: schema_version, store_id, sealing_key
    {p}:changes       pub/sub channel: the intent, on every transition

Expiry: a record's key expires at its ``reclaim_at`` (decided by the fence when it wrote
it; ``inf`` gets no TTL), so Redis reclaims records by itself and ``sweep`` mostly cleans the
auxiliary indexes; it deletes a due record only when it gets there before the key expiry.

Time: the server's ``TIME``, read inside each script. ``clock=`` replaces it with an
argument of every script: it exists for tests (a fake clock drives leases without
sleeping); with it, key TTLs are off (real time would disagree with the fake one) and sweep
reclaims.

Durability: Redis keeps an acknowledged write across a crash only with an append-only file
fsynced on every write (``appendonly yes``, ``appendfsync always``), and a failover to a
replica can lose acknowledged writes whatever the settings. The store reads the server's
persistence settings at connect and reports them (:meth:`RedisStore.durability`); see
docs/stores-redis.md. It refuses to open on a replica (what a writable one acknowledges is
lost at its next resync), and for a user who may not PUBLISH on ``{p}:changes``.

Eviction: records carry TTLs, so under a ``volatile-*`` maxmemory-policy Redis may delete a
record in flight or done before its time (a second caller is admitted: the effect runs
twice), and under ``allkeys-*`` also the token counter, domain seqs and floor (tokens restart:
a stale holder's commit passes). The store reads ``maxmemory`` and ``maxmemory-policy`` at
connect and refuses to open where eviction is possible (or cannot be ruled out) unless told
``allow_eviction``, and then says so in :meth:`RedisStore.durability` and ``describe()``.

Cluster: every key of a prefix lives in one hash slot, and the store talks to the one node
its URL names, following no redirect. While that slot migrates, a script that wrote and then
touched a key not (or no longer) on the node fails halfway, its first writes applied (a
commit deleted the record in flight, and an identical call was admitted again once the
reshard ended; found by review; ``put`` no longer deletes first, but the scripts are not
proven safe through a migration). So the store refuses a server in cluster mode (or one
whose mode cannot be read) unless told ``allow_cluster``, and then says so in the verdict.

Errors: no connection, or a server that refused a command before running it (READONLY
after a failover, OOM, LOADING, BUSY, MISCONF, NOREPLICAS, CLUSTERDOWN, TRYAGAIN,
MASTERDOWN, and the scripts' own NOTMASTER, NOINFO and NOPUBLISH: nothing applied), raises
:class:`~effectfence.errors.StoreUnavailable` with the server's reply; any other error reply
(a script error: a bug) is raised as redis-py's. A connection lost while a script ran may
have lost only the reply: ticket steps re-read and answer from what the store holds, a claim
answers unavailable (a lease it may have taken lapses like a crashed holder's). redis-py's
own retries are off: a script is never sent twice behind the store's back (the one resend is
after NOSCRIPT, an answer that says it did not run). A store built from a URL sends its
steps on connections of its own (:class:`_Connections`, :class:`_Script`), not through
``Redis.execute_command``; a client passed in is used as it is.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import urlencode, urlsplit, urlunsplit

import hiredis
import redis
import redis.exceptions
from redis.backoff import NoBackoff
from redis.retry import Retry

from effectfence.clock import HEAD_AGENTS_KEPT, MAX_HEAD_AGENTS
from effectfence.errors import StoreUnavailable
from effectfence.protocol import IntentRecord, State
from effectfence.store import _fork, mask_url, query_pairs
from effectfence.store._waiters import Waiters
from effectfence.store.base import (
    APPLIED,
    BUSY,
    EMPTY_HEAD,
    MOVED,
    RACE,
    STALE,
    FenceStore,
    Head,
    Step,
    StoreMissing,
    release_untold,
    settled,
    step_timeout,
)
from effectfence.store.codec import (
    NEVER,
    RECORD_FIELDS,
    CertCache,
    cert_from_json,
    cert_to_json,
    entry_from_json,
    entry_to_json,
)

__all__ = ["DEFAULT_PREFIX", "SCHEMA_VERSION", "RedisStore"]

SCHEMA_VERSION = 1
DEFAULT_PREFIX = "effectfence"
DEFAULT_TIMEOUT = 10.0
#: seconds between re-reads of the server's eviction settings, which an operator can change
#: at runtime (CONFIG SET): a claim in the meantime goes on what was read last
EVICTION_RECHECK = 30.0
_CERT_CACHE = 4096
_PREFIX_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_STATES = {s.value: s for s in State}
_FIELDS = RECORD_FIELDS[1:]  # the hash fields of a record (the intent is in the key)
_LOST = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
#: a listener that could not subscribe is started again at most this often (waiters poll)
_RELISTEN = 1.0
# Replies by which the server refuses a command before running it. Inside a script the same
# checks run at its first write (the server refuses it only while the script has written
# nothing, and the conditions cannot change while a script runs), and an unhandled error
# ends the script: so these mean nothing was applied. redis-py's class where it has one (its
# message drops the code), else the reply's first word.
_REFUSED_CLASSES: tuple[tuple[type[Exception], str], ...] = (
    (redis.exceptions.BusyLoadingError, "LOADING"),
    (redis.exceptions.ReadOnlyError, "READONLY"),
    (redis.exceptions.OutOfMemoryError, "OOM"),
    (redis.exceptions.MasterDownError, "MASTERDOWN"),
    (redis.exceptions.ClusterDownError, "CLUSTERDOWN"),
    (redis.exceptions.TryAgainError, "TRYAGAIN"),
    # the script is not loaded (flushed, or another server behind a proxy) even after its
    # reload: it did not run. Untyped, a commit was neither retried nor fenced, and once
    # the lease lapsed an identical call ran the effect again (found by review)
    (redis.exceptions.NoScriptError, "NOSCRIPT"),
    # the ACL refused the command (EVALSHA) or a key it declares: checked before the script
    # runs (a refusal inside one comes as a plain error). Untyped, every step of a user
    # refused EVALSHA escaped raw (found by review)
    (redis.exceptions.NoPermissionError, "NOPERM"),
    # a cluster node that does not serve the prefix's slot (the URL names another node, or
    # the cluster moved the slot): redirected, not run. Raw, naming neither (review)
    (redis.exceptions.MovedError, "MOVED"),  # a subclass of AskError: first
    (redis.exceptions.AskError, "ASK"),
)
_REFUSED_CODES = frozenset(
    ("LOADING", "READONLY", "OOM", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "MISCONF",
     "NOREPLICAS", "BUSY", "NOPUBLISH", "NOTMASTER", "NOINFO")
)  # fmt: skip
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
_pack: Callable[[tuple[Any, ...]], bytes] = hiredis.pack_command

# Shared by every script. ARGV[1] is the key prefix ("{p}"), ARGV[2] a test clock's reading
# or "" for the server's TIME.
_PRELUDE = """
local P = ARGV[1]
local TNOW = ARGV[2]
local NEVER = 1e300
local FIELDS = {'state', 'token', 'fingerprint', 'domain', 'agent', 'lease_until', 'cert',
                'until', 'reason', 'since', 'seq', 'reclaim_at'}
local function now()
    if TNOW ~= '' then return tonumber(TNOW) end
    local t = redis.call('TIME')
    return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function fmt(x) if x >= NEVER then return '1e300' end return string.format('%.17g', x) end
local function ifmt(x) return string.format('%d', x) end
local function deadline(x) if x >= NEVER then return NEVER end return x end
local function get(key)
    local r = redis.call('HMGET', key, unpack(FIELDS))
    if not r[1] then return nil end
    return r
end
local function floor_()
    return tonumber(redis.call('HGET', P .. ':fence', 'floor') or '0')
end
local function at(domain)
    local s = redis.call('HGET', P .. ':d:' .. domain, 'seq')
    if s then return tonumber(s) end
    return floor_()
end
-- write a whole record, its expiry (at reclaim_at) and its reclaim index entry
local function put(key, intent, r)
    -- every field is written, so only the old TTL needs clearing: PERSIST, not DEL. In a
    -- cluster whose slot migrates, the key DEL removed counted as not on this node, and the
    -- HSET after it failed halfway through a commit, the record lost (found by review)
    redis.call('PERSIST', key)
    redis.call('HSET', key, 'state', r.state, 'token', r.token, 'fingerprint', r.fingerprint,
        'domain', r.domain, 'agent', r.agent, 'lease_until', fmt(r.lease_until),
        'cert', r.cert, 'until', fmt(r['until']), 'reason', r.reason, 'since', fmt(r.since),
        'seq', r.seq, 'reclaim_at', fmt(r.reclaim_at))
    if r.reclaim_at < NEVER then
        if TNOW == '' then redis.call('PEXPIREAT', key, math.ceil(r.reclaim_at * 1000)) end
        redis.call('ZADD', P .. ':reclaim', fmt(r.reclaim_at), cjson.encode({intent, r.domain}))
    end
end
local function from(cur)
    return {state = cur[1], token = cur[2], fingerprint = cur[3], domain = cur[4],
            agent = cur[5], lease_until = 0, cert = '', ['until'] = 0, reason = '', since = 0,
            seq = cur[11], reclaim_at = NEVER}
end
local function compare(first)
    for i = first, #ARGV, 2 do
        local got = at(ARGV[i])
        if got ~= tonumber(ARGV[i + 1]) then return {ARGV[i], ARGV[i + 1], ifmt(got)} end
    end
    return nil
end
local function changed(intent) redis.call('PUBLISH', P .. ':changes', intent) end
-- every writing step checks first, before any write (Lua does not roll back), that its
-- writes can hold, else refuses with a code in _REFUSED_CODES: nothing applied.
-- NOTMASTER: a replica that accepts writes (replica-read-only no) drops them at its next
-- resync, unseen by the master, where a fence admits the same intent again. A failover
-- can demote the server under a running store; the store's periodic re-read of the role
-- caught only claims, after up to eviction_recheck seconds, and a commit or release sent
-- in that window applied there (found by review).
-- NOPUBLISH: Redis 7 gives a new ACL user no channels (acl-pubsub-default resetchannels),
-- and a PUBLISH refused after the writes left them applied and the caller an untyped
-- error (found by review).
local function may_write()
    -- pcall: refused by the ACL, or renamed away (rename-command), INFO raised a bug-class
    -- error (found by review)
    local ok, info = pcall(redis.call, 'INFO', 'replication')
    if not ok or type(info) ~= 'string' then
        error({err = 'NOINFO this user may not run INFO replication, or the server renamed '
            .. 'it: every step runs it to check that the server is a master (grant it: ACL '
            .. 'SETUSER <user> +info|replication; keep the INFO command).'})
    end
    if not string.find(info, '\\nrole:master\\r', 1, true) then
        error({err = 'NOTMASTER this server is not a master (a failover demoted it?): what '
            .. 'it accepted would be lost at its next resync. Point the store at the master.'})
    end
    if redis.acl_check_cmd and not redis.acl_check_cmd('PUBLISH', P .. ':changes') then
        error({err = 'NOPUBLISH this user may not PUBLISH to the channel ' .. P .. ':changes, '
            .. 'where every step announces its change (grant it: ACL SETUSER <user> &' .. P
            .. ':changes).'})
    end
end
"""

_READ = """
-- KEYS[1] the record's key
-- ARGV[1] prefix  ARGV[2] test clock or ''
-- -> {now, record fields (HMGET order)}
return {fmt(now()), redis.call('HMGET', KEYS[1], unpack(FIELDS))}
"""

_NOW = """
-- KEYS: none  ARGV[1] prefix  ARGV[2] test clock or ''  -> now
return fmt(now())
"""

_SEALING_KEY = """
-- KEYS[1] the prefix's meta hash  ARGV[1] prefix  ARGV[2] ''  ARGV[3] a new key, if none
-- -> the sealing key (hex). Read first: one there is kept as is. Made only where writes hold:
-- on a demoted writable replica a first key was made there and lost at its resync, and
-- every ticket sealed with it refused after (HSETNX outside may_write(), found by review)
local key = redis.call('HGET', KEYS[1], 'sealing_key')
if key then return key end
may_write()
redis.call('HSET', KEYS[1], 'sealing_key', ARGV[3])
return ARGV[3]
"""

_CURRENT = """
-- KEYS[1] the domain's hash  KEYS[2] the fence hash (declared, not read by name: a cluster
-- node that does not serve them redirects before the script runs, typed; undeclared, the
-- script failed inside with an untyped error, found by review)
-- ARGV[1] prefix  ARGV[2] ''  ARGV[3] domain  -> its seq (an absent one: floor)
return ifmt(at(ARGV[3]))
"""

_IN_FLIGHT = """
-- KEYS[1] the domain's in-flight set
-- ARGV[1] prefix  ARGV[2] ''  ARGV[3] domain  -> members really in flight on it
local n = 0
for _, intent in ipairs(redis.call('SMEMBERS', KEYS[1])) do
    local r = redis.call('HMGET', P .. ':i:' .. intent, 'state', 'domain')
    if r[1] == 'in_flight' and r[2] == ARGV[3] then n = n + 1 end
end
return n
"""

_CLAIM = """
-- KEYS[1] record  KEYS[2] domain hash  KEYS[3] tokens  KEYS[4] in-flight set of the domain
-- KEYS[5] domain set
-- ARGV[1] prefix  ARGV[2] test clock or ''  ARGV[3] intent
-- ARGV[4] '1': the decider observed a record, '0': none
-- ARGV[5..8] the observed record's token, state, lease_until, until
-- ARGV[9] fingerprint  ARGV[10] domain  ARGV[11] agent  ARGV[12] lease_ttl
-- ARGV[13] reclaim_after  ARGV[14] reserve_at or ''  ARGV[15..] compared domain, seq, ...
-- -> {outcome, found record or nil, token, seq, now, head, clock, stale triple}; now in every
-- answer: the store is put-first, and the decider judges what a claim found at that time
may_write()
local cur = get(KEYS[1])
-- condition 1, slot: the record is the version the decider observed (base.same_record)
if (cur ~= nil) ~= (ARGV[4] == '1') or (cur and not (tonumber(cur[2]) == tonumber(ARGV[5])
        and cur[1] == ARGV[6] and tonumber(cur[6]) == tonumber(ARGV[7])
        and tonumber(cur[8]) == tonumber(ARGV[8]))) then
    return {'moved', cur or false, '', '', fmt(now())}
end
-- condition 2, compare: every (domain, seq) of the read set holds
local stale = compare(15)
if stale then return {'stale', cur or false, '', '', fmt(now()), false, false, stale} end
-- condition 3, reserve: compare-exchange at reserve_at, else the next seq
local domain = ARGV[10]
local s = redis.call('HGET', KEYS[2], 'seq')
local seq
if ARGV[14] == '' then
    if s then seq = redis.call('HINCRBY', KEYS[2], 'seq', 1)
    else seq = floor_() + 1 end
else
    local have = s and tonumber(s) or floor_()
    if have ~= tonumber(ARGV[14]) then  -- lost, without creating the domain (G7)
        return {'race', cur or false, '', '', fmt(now()), false, false,
                {domain, ARGV[14], ifmt(have)}}
    end
    seq = have + 1
end
if not s or ARGV[14] ~= '' then redis.call('HSET', KEYS[2], 'seq', ifmt(seq)) end
redis.call('SADD', KEYS[5], domain)
local token = redis.call('INCR', KEYS[3])
local t = now()
put(KEYS[1], ARGV[3], {state = 'in_flight', token = ifmt(token), fingerprint = ARGV[9],
    domain = domain, agent = ARGV[11], lease_until = deadline(t + tonumber(ARGV[12])),
    cert = '', ['until'] = 0, reason = '', since = 0, seq = ifmt(seq),
    reclaim_at = deadline(t + tonumber(ARGV[13]))})
if cur and cur[1] == 'in_flight' and cur[4] ~= domain then
    redis.call('SREM', P .. ':fl:' .. cur[4], ARGV[3])
end
redis.call('SADD', KEYS[4], ARGV[3])
local head = redis.call('HMGET', KEYS[2], 'head', 'clock')
changed(ARGV[3])
return {'applied', cur or false, ifmt(token), ifmt(seq), fmt(t), head[1], head[2]}
"""

_COMPLETE = """
-- KEYS[1] record
-- ARGV[1] prefix  ARGV[2] test clock or ''  ARGV[3] intent  ARGV[4] token
-- ARGV[5] certificate JSON  ARGV[6] its hash  ARGV[7] its vector clock (JSON)
-- ARGV[8] result_ttl  ARGV[9] reclaim_after  ARGV[10] own_seq or ''  ARGV[11] stale_reason
-- ARGV[12] stale_reclaim_after  ARGV[13] certificates kept per domain, '' for all
-- ARGV[14] the ticket's fingerprint  ARGV[15..] compared domain, seq, ...
-- -> {outcome, found record or nil, now, stale triple}
may_write()
local cur = get(KEYS[1])
-- compare-by-token: in flight under this token, with the ticket's payload
if not cur or cur[1] ~= 'in_flight' or tonumber(cur[2]) ~= tonumber(ARGV[4])
   or cur[3] ~= ARGV[14] then
    return {'moved', cur or false}
end
local domain = cur[4]
local stale = compare(15)
if not stale and ARGV[10] ~= '' then
    local got = at(domain)
    if got ~= tonumber(ARGV[10]) then stale = {domain, ARGV[10], ifmt(got)} end
end
local t = now()
local r = from(cur)
redis.call('SREM', P .. ':fl:' .. domain, ARGV[3])
if stale then  -- a dependency moved while the effect ran: FAILED, not DONE
    r.state = 'failed'; r.reason = ARGV[11]; r.since = t
    r.reclaim_at = deadline(t + tonumber(ARGV[12]))
    put(KEYS[1], ARGV[3], r)
    changed(ARGV[3])
    return {'stale', cur, fmt(t), stale}
end
r.state = 'done'; r.cert = ARGV[5]; r['until'] = deadline(t + tonumber(ARGV[8]))
r.reclaim_at = deadline(t + tonumber(ARGV[9]))
put(KEYS[1], ARGV[3], r)
-- the domain's head: this certificate, its clock merged (element-wise max) into the head's;
-- past MAX_HEAD_AGENTS agents, the HEAD_AGENTS_KEPT with the most events, ties to the smaller
-- name in byte order (clock.merge_head; Lua's own string order follows the server's locale)
local dkey = P .. ':d:' .. domain
local old = redis.call('HGET', dkey, 'clock')
local merged = old and cjson.decode(old) or {}
for agent, n in pairs(cjson.decode(ARGV[7])) do
    if not merged[agent] or merged[agent] < n then merged[agent] = n end
end
local kept = {}
for agent, n in pairs(merged) do kept[#kept + 1] = {agent, n} end
if #kept > MAX_HEAD_AGENTS then
    local function first(x, y)
        if x[2] ~= y[2] then return x[2] > y[2] end
        local a, b = x[1], y[1]
        for i = 1, math.min(#a, #b) do
            local ca, cb = a:byte(i), b:byte(i)
            if ca ~= cb then return ca < cb end
        end
        return #a < #b
    end
    table.sort(kept, first)
    for i = #kept, HEAD_AGENTS_KEPT + 1, -1 do kept[i] = nil end
end
local parts = {}
for _, e in ipairs(kept) do parts[#parts + 1] = cjson.encode(e[1]) .. ':' .. ifmt(e[2]) end
redis.call('HSET', dkey, 'head', ARGV[6], 'clock', '{' .. table.concat(parts, ',') .. '}')
local ckey = P .. ':c:' .. domain
redis.call('ZADD', ckey, cur[11], ARGV[5])
if ARGV[13] ~= '' then  -- certs_per_domain: the oldest seqs go, a prefix of the trail
    local over = redis.call('ZRANGE', ckey, 0, -(tonumber(ARGV[13]) + 1), 'WITHSCORES')
    if #over > 0 then  -- where the trail now starts, for the trail check (trail_cut)
        local top = tonumber(over[#over])
        local was = tonumber(redis.call('HGET', P .. ':cuts', domain) or '0')
        if top > was then redis.call('HSET', P .. ':cuts', domain, ifmt(top)) end
        redis.call('ZREMRANGEBYRANK', ckey, 0, -(tonumber(ARGV[13]) + 1))
    end
end
changed(ARGV[3])
return {'applied', cur, fmt(t)}
""".replace("MAX_HEAD_AGENTS", str(MAX_HEAD_AGENTS)).replace(
    "HEAD_AGENTS_KEPT", str(HEAD_AGENTS_KEPT)
)

_FINISH = """
-- KEYS[1] record
-- ARGV[1] prefix  ARGV[2] test clock or ''  ARGV[3] intent  ARGV[4] token
-- ARGV[5] 'fail' | 'release' | 'renew'  ARGV[6] reason  ARGV[7] lease_ttl
-- ARGV[8] reclaim_after
-- -> {outcome, found record or nil, now}
may_write()
local cur = get(KEYS[1])
if not cur or cur[1] ~= 'in_flight' or tonumber(cur[2]) ~= tonumber(ARGV[4]) then
    return {'moved', cur or false}
end
local t = now()
local r = from(cur)
if ARGV[5] == 'release' then
    redis.call('DEL', KEYS[1])
    redis.call('SREM', P .. ':fl:' .. cur[4], ARGV[3])
elseif ARGV[5] == 'fail' then
    r.state = 'failed'; r.reason = ARGV[6]; r.since = t
    r.reclaim_at = deadline(t + tonumber(ARGV[8]))
    put(KEYS[1], ARGV[3], r)
    redis.call('SREM', P .. ':fl:' .. cur[4], ARGV[3])
else
    r.lease_until = deadline(t + tonumber(ARGV[7]))
    r.reclaim_at = deadline(t + tonumber(ARGV[8]))
    put(KEYS[1], ARGV[3], r)
end
changed(ARGV[3])
return {'applied', cur, fmt(t)}
"""

_CLEAR = """
-- KEYS[1] record  ARGV[1] prefix  ARGV[2] ''  ARGV[3] intent  -> the record removed, or nil
may_write()
local cur = get(KEYS[1])
if not cur then return false end
redis.call('DEL', KEYS[1])
redis.call('SREM', P .. ':fl:' .. cur[4], ARGV[3])
changed(ARGV[3])
return cur
"""

_CLEAR_IF = """
-- KEYS[1] record  KEYS[2] audit zset  KEYS[3] audit id counter
-- ARGV[1] prefix  ARGV[2] test clock or ''  ARGV[3] intent
-- ARGV[4..7] the judged record's token, state, lease_until, until  ARGV[8] entry JSON
-- -> {'moved', found record or false} | {'applied', found record, id, now}
may_write()
local cur = get(KEYS[1])
-- the condition: still the version the decider judged (base.same_record)
if not cur or not (tonumber(cur[2]) == tonumber(ARGV[4]) and cur[1] == ARGV[5]
        and tonumber(cur[6]) == tonumber(ARGV[6]) and tonumber(cur[8]) == tonumber(ARGV[7])) then
    return {'moved', cur or false}
end
local t = now()
redis.call('DEL', KEYS[1])
redis.call('SREM', P .. ':fl:' .. cur[4], ARGV[3])
-- the audit entry, in the same script: a clear nobody can account for never happens
local id = redis.call('INCR', KEYS[3])
redis.call('ZADD', KEYS[2], id, cjson.encode({id, fmt(t), ARGV[3], ARGV[8]}))
changed(ARGV[3])
return {'applied', cur, ifmt(id), fmt(t)}
"""

_EVICT = """
-- KEYS[1] domain hash  KEYS[2] its in-flight set  KEYS[3] fence hash  KEYS[4] domain set
-- ARGV[1] prefix  ARGV[2] ''  ARGV[3] domain  -> {'busy', n} | {'applied', seq or nil}
may_write()  -- left out at first: on a demoted writable replica it answered APPLIED (review)
local busy = 0
for _, intent in ipairs(redis.call('SMEMBERS', KEYS[2])) do
    local r = redis.call('HMGET', P .. ':i:' .. intent, 'state', 'domain')
    if r[1] == 'in_flight' and r[2] == ARGV[3] then busy = busy + 1 end
end
if busy > 0 then return {'busy', busy} end
local s = redis.call('HGET', KEYS[1], 'seq')
if not s then return {'applied', false} end
redis.call('DEL', KEYS[1], KEYS[2])
redis.call('SREM', KEYS[4], ARGV[3])
-- above every seq the domain handed out: no (domain, seq) pair matches again (G5)
if tonumber(s) + 1 > floor_() then redis.call('HSET', KEYS[3], 'floor', ifmt(tonumber(s) + 1)) end
return {'applied', s}
"""

_SWEEP = """
-- KEYS[1] reclaim index
-- ARGV[1] prefix  ARGV[2] test clock or ''  ARGV[3] batch
-- -> {records deleted, index entries visited}
may_write()
local t = now()
local due = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', fmt(t), 'LIMIT', 0, tonumber(ARGV[3]))
local n = 0
for _, m in ipairs(due) do
    local e = cjson.decode(m)
    local key = P .. ':i:' .. e[1]
    local r = redis.call('HMGET', key, 'reclaim_at', 'state', 'domain')
    if r[1] and tonumber(r[1]) <= t then
        -- the version that set this deadline (a rewrite moves it): reclaim it
        redis.call('DEL', key)
        if r[2] == 'in_flight' then redis.call('SREM', P .. ':fl:' .. r[3], e[1]) end
        changed(e[1])
        n = n + 1
    elseif not (r[2] == 'in_flight' and r[3] == e[2]) then
        -- gone already (its key expired, or it was cleared), or another version not in
        -- flight on this entry's domain (claimed again once its key expired, perhaps on
        -- another domain; found by review: the old domain's set kept it for ever)
        redis.call('SREM', P .. ':fl:' .. e[2], e[1])
    end
    redis.call('ZREM', KEYS[1], m)
end
return {n, #due}
"""


class _Connections:
    """The connections a store's own client uses for its steps: a free list.

    Why not the client's pool: its checkout and return record observability metrics and
    dispatch events (redis-py 8), ~10 us a step. A connection is checked before reuse (a
    peer that hung up while it idled is replaced, so a step never meets it), a connection
    that broke mid-reply is dropped, and a forked child starts with none of its parent's."""

    def __init__(self, pool: redis.ConnectionPool) -> None:
        self._make: Callable[[], Any] = lambda: pool.connection_class(**pool.connection_kwargs)
        self._max: int = pool.max_connections  # the bound the pool would have kept
        self._free: list[Any] = []
        self._all: list[Any] = []
        self._lock = _fork.lock()
        self._fork = _fork.generation()

    def take(self) -> Any:
        if self._fork != _fork.generation():
            self._forked()
        try:
            conn = self._free.pop()
        except IndexError:
            with self._lock:
                if len(self._all) >= self._max:  # as the pool would: refused, nothing sent
                    raise redis.exceptions.ConnectionError(
                        f"too many connections ({self._max}, max_connections)"
                    ) from None
                conn = self._make()
                self._all.append(conn)
            return conn
        try:  # the peer hung up (EOF) or left stray data: not in step, reconnect
            stale = conn._sock is not None and conn.can_read()
        except _LOST:
            stale = True
        if stale:
            conn.disconnect()  # the next send connects again
        return conn

    def _forked(self) -> None:
        """A forked child's first step: the sockets are the parent's, left to it untouched
        (see :mod:`effectfence.store._fork`), and the lock, which a thread of the parent
        may have held at the fork, is the child's own."""
        with _fork.LOCK:
            if self._fork == _fork.generation():  # another thread of the child came first
                return
            _fork.abandon(*self._all)
            self._free, self._all = [], []
            self._fork = _fork.generation()

    def give(self, conn: Any) -> None:
        self._free.append(conn)

    def drop(self, conn: Any) -> None:
        conn.disconnect()
        with self._lock, contextlib.suppress(ValueError):
            self._all.remove(conn)

    def close(self) -> None:
        with self._lock:
            conns, self._all, self._free = self._all, [], []
        for conn in conns:
            with contextlib.suppress(Exception):
                conn.disconnect()


class _Script:
    """One Lua step, called as redis-py's ``Script`` is: ``script(keys=..., args=...)``.

    On the store's own connections (:class:`_Connections`) it sends EVALSHA packed by
    hiredis, without ``Redis.execute_command``'s per-command layers (retry, observability and
    deprecation checks). Measured here per call: EVALSHA through ``Script.__call__`` ~100-110
    us, this ~85-90 us; a GET through redis-py ~90-100 us. Kept from those layers: loading the
    script when the server lost it (a restart, SCRIPT FLUSH), and a connection broken
    mid-reply is dropped, never reused. A client the caller passed in goes through
    redis-py's ``Script`` and that client's own pool."""

    __slots__ = ("_conns", "_script", "sha")

    def __init__(self, client: redis.Redis, source: str, conns: _Connections | None) -> None:
        self._script = client.register_script(source)
        self.sha = self._script.sha
        self._conns = conns

    def __call__(self, keys: Sequence[str], args: Sequence[Any]) -> Any:
        conns = self._conns
        if conns is None:
            return self._script(keys=keys, args=args)
        command = ("EVALSHA", self.sha, len(keys), *keys, *args)
        conn = conns.take()
        try:
            conn.send_packed_command([_pack(command)], check_health=False)
            try:
                out = conn.read_response()
            except redis.exceptions.NoScriptError:
                conn.send_command("SCRIPT", "LOAD", self._script.script)
                conn.read_response()
                conn.send_packed_command([_pack(command)], check_health=False)
                out = conn.read_response()
        except redis.exceptions.ResponseError:
            conns.give(conn)  # the server answered in full: the connection is in step
            raise
        except BaseException:
            conns.drop(conn)  # a reply may be half read: this connection is done
            raise
        conns.give(conn)
        return out


class _Lost(Exception):
    """The connection broke while a script ran: it may or may not have applied."""


_OURS = (
    "prefix",
    "allow_eviction",
    "allow_cluster",
    "certs_per_domain",
    "max_connections",
    "timeout",
)


@functools.cache
def _redis_py_options() -> frozenset[str]:
    """What redis-py takes in a URL's query: its parsed arguments, and the keywords of its
    connection classes (it passes any other query argument on as one)."""
    import inspect

    from redis import connection

    names = set(getattr(connection, "URL_QUERY_ARGUMENT_PARSERS", {}))
    for cls in (connection.AbstractConnection, connection.Connection, connection.SSLConnection):
        names.update(inspect.signature(cls.__init__).parameters)
    return frozenset(names - {"self", "args", "kwargs"})


def _reader_stops(exc: BaseException) -> bool:
    """A settings reader (CONFIG, INFO, ROLE) stops on a refusal of the server's (LOADING,
    BUSY...: the open is refused with it), but not on the ACL's refusal of its own command:
    then it reads another way, or reports the setting unknown, rather than refuse to open."""
    return _refused(exc) is not None and not isinstance(exc, redis.exceptions.NoPermissionError)


def _refused(exc: BaseException) -> str | None:
    """The server's reply if it refused the command before running it (nothing applied),
    else None: a lost connection, or an error no one can say applied nothing."""
    for cls, code in _REFUSED_CLASSES:
        if isinstance(exc, cls):
            return f"{code} {exc}"
    if isinstance(exc, redis.exceptions.ResponseError):
        said = str(exc)
        if said.split(" ", 1)[0] in _REFUSED_CODES:
            return said
    return None


def _redirected(said: str) -> str:
    """What to do about a cluster's redirect (``MOVED|ASK <slot> <host:port>``)."""
    code, slot, node = [*said.split(), "?", "?", "?"][:3]
    if code == "ASK":  # the slot is on its way to that node: no node serves it whole
        return (
            f"hash slot {slot}, where every key of this prefix lives, is migrating to {node}: "
            "point the store's URL at whichever node serves it once the migration ends"
        )
    return (
        f"point the store's URL at {node}, the cluster node serving hash slot {slot}, where "
        "every key of this prefix lives: the store talks to one node and follows no redirect"
    )


def _flag(name: str, v: str) -> bool:
    if v.lower() in _TRUE:
        return True
    if v.lower() in _FALSE:
        return False
    raise ValueError(f"{name} must be true or false, got {v!r}")


def _deadline(v: Any) -> float:
    t = float(v)
    return math.inf if t >= NEVER else t


def _text(v: Any) -> str:
    """A reply as text (redis-py answers bytes here: decode_responses is off)."""
    return v.decode() if isinstance(v, bytes) else str(v)


def _num(x: float) -> str:
    """A duration or reading as a script argument (infinity as the stored "never")."""
    return repr(min(float(x), NEVER))


def _not_master(role: str | None) -> str | None:
    """Why a server of this replication role can't hold the fence (None: it can). Fails
    closed on a role that can't be read (found by review: the store opened there)."""
    if role == "master":
        return None
    if role is None:
        return (
            "the server's replication role can't be read (INFO and ROLE refused to this "
            "user): on a replica, writes are lost at its next resync and never reach the "
            "master, where another fence would admit the same intent again"
        )
    return (
        f"the server's role is {role}, not master: writes to a replica are lost at its next "
        "resync and are not seen by the master, where another fence would admit the same "
        "intent again. Open the store on the master"
    )


class RedisStore(FenceStore):
    """Store in one Redis database, shared by every process that reaches it.

    ``url``: a redis-py URL; or ``client``: a :class:`redis.Redis` of your own (its retries
    should be off). ``prefix``: the hash tag every key lives under. ``certs_per_domain``:
    how many certificates the audit trail keeps per domain (None: all). ``clock``: for tests
    only, replaces the server's ``TIME`` in every script. ``allow_eviction``: open even where
    the server may evict keys (maxmemory with a policy other than noeviction, or settings that
    cannot be read); refused otherwise, since an evicted record or counter lets an effect run
    twice. Reported in :meth:`durability` and ``describe()``. ``allow_cluster``: open on a
    server in cluster mode (or whose mode cannot be read): refused otherwise, since a step
    while the prefix's slot migrates can apply in part (see the module's doc).
    ``create=False``: open only a prefix some store wrote (:class:`StoreMissing` otherwise),
    for looking without writing.
    """

    name = "redis"
    counters_backend = "lua"
    shared = True
    # a claim that finds a record writes nothing and holds no lock: as cheap as a read, so a
    # fresh attempt is two round trips (claim, complete), a replay still one
    put_first = True

    def __init__(
        self,
        url: str | None = None,
        *,
        client: redis.Redis | None = None,
        prefix: str = DEFAULT_PREFIX,
        timeout: float = DEFAULT_TIMEOUT,
        certs_per_domain: int | None = None,
        clock: Callable[[], float] | None = None,
        max_connections: int = 64,
        allow_eviction: bool = False,
        allow_cluster: bool = False,
        create: bool = True,
    ) -> None:
        if (url is None) == (client is None):
            raise ValueError("give a Redis store either url or client, not both")
        if not _PREFIX_NAME.match(prefix):
            raise ValueError(f"prefix must match {_PREFIX_NAME.pattern}, got {prefix!r}")
        if certs_per_domain is not None and certs_per_domain < 1:
            raise ValueError("certs_per_domain must be >= 1, or None to keep all")
        self.prefix = prefix
        self._create = create
        self._p = "{" + prefix + "}"
        self._clock = clock
        self.timeout = step_timeout(timeout)
        self.certs_per_domain = certs_per_domain
        self._closed = False
        self.allow_eviction = bool(allow_eviction)
        self.allow_cluster = bool(allow_cluster)
        self._own_client = client is None
        self._url = url or "redis://(client)"
        if client is None:
            assert url is not None
            client = redis.Redis.from_url(
                url,
                socket_timeout=self.timeout,
                socket_connect_timeout=self.timeout,
                retry=Retry(NoBackoff(), 0),
                max_connections=max_connections,
            )
        if client.get_connection_kwargs().get("decode_responses"):
            # the steps read bytes: with str replies a commit applied on the server and
            # then raised, and every replay of it raised (found by review)
            raise ValueError(
                "the Redis store needs a client without decode_responses (it reads bytes)"
            )
        self._r: redis.Redis = client
        self._certs = CertCache(_CERT_CACHE)
        self._key: bytes | None = None
        r = self._r
        # the store's own client: steps on its own connections (see _Connections)
        self._conns = _Connections(r.connection_pool) if self._own_client else None
        self._s_read = _Script(r, _PRELUDE + _READ, self._conns)
        self._s_now = _Script(r, _PRELUDE + _NOW, self._conns)
        self._s_current = _Script(r, _PRELUDE + _CURRENT, self._conns)
        self._s_sealing_key = _Script(r, _PRELUDE + _SEALING_KEY, self._conns)
        self._s_in_flight = _Script(r, _PRELUDE + _IN_FLIGHT, self._conns)
        self._s_claim = _Script(r, _PRELUDE + _CLAIM, self._conns)
        self._s_complete = _Script(r, _PRELUDE + _COMPLETE, self._conns)
        self._s_finish = _Script(r, _PRELUDE + _FINISH, self._conns)
        self._s_clear = _Script(r, _PRELUDE + _CLEAR, self._conns)
        self._s_clear_if = _Script(r, _PRELUDE + _CLEAR_IF, self._conns)
        self._s_evict = _Script(r, _PRELUDE + _EVICT, self._conns)
        self._s_sweep = _Script(r, _PRELUDE + _SWEEP, self._conns)
        self._waiters = Waiters()
        self._listener: threading.Thread | None = None
        self._listener_lock = _fork.lock()
        self._live = False  # the listener's subscription is confirmed
        self._relisten_at = 0.0
        self.eviction_recheck = EVICTION_RECHECK
        self._checked_at = time.monotonic()  # when the eviction settings were read
        self._recheck_lock = _fork.lock()
        self._evicting: str | None = None  # why claims are refused, while eviction is on
        self._demoted: str | None = None  # why claims are refused, while not on a master
        self._judged_at_open: tuple[bool, str] | None = None  # the verdict, while demoted
        self._cluster_warning = ""  # opened with allow_cluster: the verdict starts so
        try:
            # a first round trip, on its own: the connection's own set-up (SELECT of a
            # database other than 0, CLIENT SETNAME) refused by an ACL came out of the
            # settings' readers as "unreadable", refused under the wrong name (review).
            # TIME, which every step needs: PING refused users the line had let in (review)
            self._r.time()
            # settings first: a server the store refuses gets nothing written
            self._durability = self._read_persistence()
            self._durability.update(self._read_eviction())
            self._durability.update(self._read_cluster())
            self._refuse_eviction()
            self._refuse_cluster()
            self._refuse_replica()
            self._refuse_unwritable()
            self.store_id = self._init()
        except StoreUnavailable:  # a ConnectionError, so an OSError: before _LOST
            self.close()
            raise
        except redis.exceptions.NoPermissionError as exc:  # a ResponseError: before it
            # a user refused EVALSHA, or the store's keys, got redis-py's raw error
            self.close()
            raise StoreUnavailable(
                f"refusing to open the Redis store at {mask_url(self._url)}: its user is "
                f"refused what the store needs ({exc})",
                operation="open",
                retryable=False,
                recover=f"grant the store's user its keys, channel and commands: ACL SETUSER "
                f"<user> ~{self._p}:* &{self._p}:changes +@scripting +@read +@write "
                "+@pubsub +info +role +time +config|get +ping +select +client|setname",
                setting="acl",
            ) from exc
        except redis.exceptions.AskError as exc:  # MOVED too: a ResponseError, before it
            self.close()
            redirect = _refused(exc) or str(exc)
            raise StoreUnavailable(
                f"refusing to open the Redis store at {mask_url(self._url)}: this cluster "
                f"node does not serve the prefix's keys ({redirect})",
                operation="open",
                retryable=redirect.startswith("ASK "),  # a migration ends; a MOVED stays
                recover=_redirected(redirect),
                setting="cluster",
                server_reply=redirect,
            ) from exc
        except (*_LOST, redis.exceptions.ResponseError) as exc:
            self.close()
            said = _refused(exc)
            if said is None and not isinstance(exc, _LOST):
                # the server refused what the URL asks ("DB index is out of range"): typed,
                # not a raw driver error (a traceback from the CLI, found by review), and
                # not worth retrying as it stands
                raise StoreUnavailable(
                    f"can't open the Redis store at {mask_url(self._url)}: the server "
                    f"refused it: {exc}",
                    operation="open",
                    retryable=False,
                    recover="check the URL (its database number, user and options) against "
                    "the server's configuration",
                    server_reply=str(exc),
                ) from exc
            raise StoreUnavailable(
                f"can't open the Redis store at {mask_url(self._url)}: {said or exc}",
                operation="open",
                server_reply=said,
            ) from exc
        except BaseException:
            self.close()
            raise
        self.ticket_scope = f"redis:{self.store_id}"

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisStore:
        """``redis://host:6379/0?prefix=fence&certs_per_domain=1000&allow_eviction=false``;
        keywords win over the query; other query parameters go to redis-py."""
        parts = urlsplit(url)
        ours: dict[str, Any] = {}
        theirs: list[tuple[str, str]] = []
        for k, v in query_pairs(parts.query, url):
            if k not in _OURS and k not in _redis_py_options():
                # redis-py took it as a keyword and raised a raw TypeError (review)
                raise ValueError(
                    f"unknown option {k!r} in {mask_url(url)}: this store's are "
                    f"{', '.join(_OURS)}; the rest go to redis-py, which knows no {k!r}"
                )
            try:
                if k == "prefix":
                    ours[k] = v
                elif k in ("allow_eviction", "allow_cluster"):
                    ours[k] = _flag(k, v)
                elif k in ("certs_per_domain", "max_connections"):
                    ours[k] = int(v)
                elif k == "timeout":
                    ours[k] = float(v)
                else:
                    theirs.append((k, v))
            except ValueError:
                what = "true or false" if k.startswith("allow_") else "a number"
                raise ValueError(f"{k} in {mask_url(url)} must be {what}") from None
        ours.update(options)
        if "client" in ours:
            return cls(**ours)
        # the database is the path's number: redis-py read "/4x" as database 0 without a
        # word, and a "db=" in the query won over the path's (found by review): another
        # database is another ledger, where committed intents run again
        db = parts.path.strip("/")
        if parts.scheme.lower() != "unix" and db and not db.isdigit():
            raise ValueError(
                f"the database in {mask_url(url)} must be a number (redis://host:port/N), "
                f"got {db!r}"
            )
        if db and any(k == "db" for k, _ in theirs):
            raise ValueError(
                f"{mask_url(url)} names the database twice, in the path and as db=: give it once"
            )
        rest = urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(theirs), ""))
        return cls(rest, **ours)

    def __repr__(self) -> str:
        return f"RedisStore(url={mask_url(self._url)!r}, prefix={self.prefix!r})"

    # -- setup and durability -----------------------------------------------------------------
    def _init(self) -> str:
        meta = f"{self._p}:meta"
        r = self._r
        if not self._create and not r.exists(meta):
            raise StoreMissing(
                f"no store under Redis prefix {self.prefix!r}: nothing has used it yet, or "
                "the URL names another prefix or database"
            )
        r.hsetnx(meta, "schema_version", str(SCHEMA_VERSION))
        r.hsetnx(meta, "store_id", secrets.token_hex(16))
        version, store_id = r.hmget(meta, ["schema_version", "store_id"])
        if version is None or not version.isdigit() or int(version) > SCHEMA_VERSION:
            raise RuntimeError(
                f"Redis prefix {self.prefix!r} holds effectfence data version {version!r}; this "
                f"effectfence reads version {SCHEMA_VERSION}: upgrade it (or use another prefix)"
            )
        return _text(store_id)

    def _read_persistence(self) -> dict[str, Any]:
        """The server's persistence settings: CONFIG GET, or INFO persistence where CONFIG is
        disabled (managed services)."""
        out: dict[str, Any] = {}
        try:
            for name in ("appendonly", "appendfsync", "no-appendfsync-on-rewrite", "save"):
                got = self._r.config_get(name)
                out[name] = got.get(name) if isinstance(got, dict) else None
                if isinstance(out[name], bytes):
                    out[name] = out[name].decode()
            out["source"] = "CONFIG GET"
        except redis.exceptions.ResponseError as exc:
            if _reader_stops(exc):
                raise
            try:
                info = self._r.info("persistence")
                appendonly: str | None = "yes" if info.get("aof_enabled") else "no"
                source = "INFO persistence (CONFIG is disabled)"
            except redis.exceptions.ResponseError as again:
                if _reader_stops(again):
                    raise
                appendonly, source = None, "unreadable (CONFIG GET and INFO refused)"
            out = {
                "appendonly": appendonly,
                "appendfsync": None,  # not in INFO: unknown
                "no-appendfsync-on-rewrite": None,
                "save": None,
                "source": source,
            }
        out["role"] = self._read_role()
        # no-appendfsync-on-rewrite yes skips the fsync, "always" or not, while a rewrite or
        # a snapshot runs: then durability is appendfsync no's (review). Unknown is unsafe
        skips = out.get("no-appendfsync-on-rewrite") != "no"
        synced = out.get("appendonly") == "yes" and out.get("appendfsync") == "always"
        # a replica's writes (replica-read-only no) never reach its master and are dropped at
        # the next resync: it was reported safe, and a fence on the master admitted the same
        # intent again (found by review). Only a master can be safe; unknown is not
        safe = synced and not skips and out["role"] == "master"
        out["acknowledged_writes_survive_a_crash"] = safe
        if out["role"] != "master":
            out["verdict"] = (
                f"role {out['role'] or 'unknown'}, not master: what a replica acknowledges is "
                "not seen by the master and is lost at the next resync; not safe for effects "
                "that move money"
            )
        elif synced and skips:
            out["verdict"] = (
                "appendonly yes + appendfsync always, but no-appendfsync-on-rewrite is "
                f"{out.get('no-appendfsync-on-rewrite') or 'unknown'}: while the server "
                "rewrites its append-only file or saves a snapshot it does not fsync, and a "
                "crash then can lose acknowledged steps; set no-appendfsync-on-rewrite no"
            )
        elif safe:
            out["verdict"] = (
                "appendonly yes + appendfsync always: an acknowledged step survives a crash of "
                "this server; a failover to a replica can still lose it"
            )
        elif out.get("appendonly") == "yes" and out.get("appendfsync") is None:
            out["verdict"] = "append-only file on; its fsync policy is not readable here"
        else:
            out["verdict"] = (
                f"appendonly {out.get('appendonly')}, appendfsync {out.get('appendfsync')}: a "
                "crash can lose acknowledged steps (a committed effect could run again); not "
                "safe for effects that move money"
            )
        return out

    def _read_role(self) -> str | None:
        """The server's replication role: INFO replication, else ROLE, else None (unknown)."""
        try:
            return _text(self._r.info("replication")["role"])
        except (redis.exceptions.ResponseError, KeyError) as exc:
            if _reader_stops(exc):
                raise
        try:
            role: Any = self._r.role()  # ["master" | "slave" | "sentinel", ...]
            return _text(role[0])
        except (redis.exceptions.ResponseError, IndexError, TypeError) as exc:
            if _reader_stops(exc):
                raise
        return None

    def _refuse_replica(self) -> None:
        """Fail closed on a server known to be a replica: what it accepts (replica-read-only
        no) is lost at its next resync and never seen by the master, so a fence on the master
        admits the same intent again (found by review)."""
        why = _not_master(self._durability["role"])
        if why is None:
            return
        raise StoreUnavailable(
            f"refusing to open the Redis store at {mask_url(self._url)}: {why}",
            operation="open",
            retryable=False,
            recover="point the store's URL at the Redis master, and let its user run INFO or ROLE",
            setting="role",
            role=self._durability["role"],
        )

    def _refuse_unwritable(self) -> None:
        """Fail closed where this user may not run what every writing step checks first
        (may_write() in _PRELUDE): INFO replication, or PUBLISH on the changes channel.
        Every step would be refused, so the store does not open; a right revoked later
        makes steps refuse, applying nothing."""
        try:  # the steps' own way (EVALSHA, SCRIPT LOAD): EVAL alone passed a user
            # refused EVALSHA, whose every step then failed (found by review)
            _Script(self._r, _PRELUDE + "may_write() return 1", self._conns)((), (self._p, ""))
        except redis.exceptions.NoPermissionError:
            raise  # refused at open as the ACL's (see __init__)
        except redis.exceptions.ResponseError as exc:
            said = str(exc)
            if said.startswith("NOPUBLISH "):
                grant, setting = (
                    f"the channel: ACL SETUSER <user> &{self._p}:changes",
                    "acl channels",
                )
            elif said.startswith("NOINFO "):
                grant, setting = (
                    "INFO replication (ACL SETUSER <user> +info|replication), and keep the "
                    "INFO command (not renamed or disabled)",
                    "acl",
                )
            else:
                raise
            raise StoreUnavailable(
                f"refusing to open the Redis store at {mask_url(self._url)}: {exc}",
                operation="open",
                retryable=False,
                recover=f"grant the user {grant}",
                setting=setting,
                server_reply=said,
            ) from exc

    def _read_eviction(self) -> dict[str, Any]:
        """maxmemory and maxmemory-policy: CONFIG GET, else INFO memory (managed services
        disable CONFIG), else unknown. Eviction is possible when maxmemory > 0 and the policy
        is not noeviction (maxmemory 0: no limit, nothing is evicted)."""
        maxmemory: int | None = None
        policy: str | None = None
        source = "CONFIG GET"
        try:
            got = {**self._r.config_get("maxmemory"), **self._r.config_get("maxmemory-policy")}
            maxmemory = int(_text(got["maxmemory"]))
            policy = _text(got["maxmemory-policy"])
        except (redis.exceptions.ResponseError, KeyError, ValueError) as exc:
            if _reader_stops(exc):
                raise
            try:
                info = self._r.info("memory")
                maxmemory = int(info["maxmemory"])
                policy = _text(info["maxmemory_policy"])
                source = "INFO memory (CONFIG is disabled)"
            except (redis.exceptions.ResponseError, KeyError, ValueError) as again:
                if _reader_stops(again):
                    raise
                maxmemory, policy = None, None
                source = "unreadable (CONFIG GET and INFO memory refused)"
        if maxmemory is None or policy is None:
            eviction = "unknown"
        elif maxmemory == 0 or policy == "noeviction":
            eviction = "off"
        else:
            eviction = "possible"
        return {
            "maxmemory": maxmemory,
            "maxmemory_policy": policy,
            "memory_source": source,
            "eviction": eviction,
            "eviction_allowed": self.allow_eviction,
        }

    def _recheck_eviction(self) -> None:
        """Before a claim, at most every ``eviction_recheck`` s: read the eviction settings
        again. A server switched to an evicting policy after the store opened refuses new
        claims (``store_unavailable``) until it is switched back; replays, commits and the
        rest go on, since what is stored is still right (only a new admission relies on
        nothing being evicted later). The read costs one round trip per interval."""
        if time.monotonic() - self._checked_at < self.eviction_recheck:
            return
        with self._recheck_lock:
            if time.monotonic() - self._checked_at < self.eviction_recheck:
                return
            try:
                fresh = self._read_eviction()
                # and the role: a failover that demoted this server to a writable replica
                # left the store claiming there, each claim lost at the next resync while
                # the new master admitted the intent again (found by review)
                fresh["role"] = self._read_role()
            except (*_LOST, redis.exceptions.ResponseError) as exc:
                raise self._unavailable("claim", exc) from exc
            self._checked_at = time.monotonic()
            self._durability.update(fresh)
            why = self._eviction_risk(self._durability)
            self._evicting = None if why is None or self.allow_eviction else why
            self._demoted = _not_master(fresh["role"])
            self._judge()

    def _judge(self) -> None:
        """The verdict follows the settings read again: demoted, or evicting, the server was
        still called safe beside its new settings (found by review, twice); safe again, the
        verdict read at open comes back."""
        d = self._durability
        why = [r for r in (self._demoted, self._evicting) if r is not None]
        if why:
            if self._judged_at_open is None:
                self._judged_at_open = (d["acknowledged_writes_survive_a_crash"], d["verdict"])
            d["acknowledged_writes_survive_a_crash"] = False
            # the cluster's warning stays first: a recheck's verdict dropped it (review)
            d["verdict"] = (
                f"{self._cluster_warning}{'; '.join(why)} (since the store opened); not safe "
                "for effects"
            )
        elif self._judged_at_open is not None:
            d["acknowledged_writes_survive_a_crash"], d["verdict"] = self._judged_at_open
            self._judged_at_open = None

    def _eviction_risk(self, d: Mapping[str, Any]) -> str | None:
        """Why these settings may evict the fence's keys, or None when they cannot."""
        if d["eviction"] == "off":
            return None
        if d["eviction"] == "possible":
            why = (
                f"maxmemory {d['maxmemory']} with maxmemory-policy {d['maxmemory_policy']}: "
                "Redis may evict"
            )
        else:
            why = f"maxmemory and maxmemory-policy are {d['memory_source']}: Redis may evict"
        return why + (
            " the fence's records and counters, and an evicted record or token counter lets an "
            "effect run twice"
        )

    def _read_cluster(self) -> dict[str, Any]:
        """Whether the server runs in cluster mode: INFO cluster, else CLUSTER MYID (refused
        "cluster support disabled" on a standalone server), else unknown."""
        enabled: Any = None
        try:
            enabled = self._r.info("cluster").get("cluster_enabled")
        except redis.exceptions.ResponseError as exc:
            if _reader_stops(exc):
                raise
        if enabled is not None:  # absent (a server that does not say): asked the other way
            mode = "off" if str(enabled) == "0" else "on"
        else:
            mode = "unknown"
            try:
                self._r.execute_command("CLUSTER", "MYID")  # type: ignore[no-untyped-call]
                mode = "on"
            except redis.exceptions.ResponseError as again:
                if _reader_stops(again):
                    raise
                if "cluster support disabled" in str(again):
                    mode = "off"
        return {"cluster": mode, "cluster_allowed": self.allow_cluster}

    def _refuse_cluster(self) -> None:
        """Fail closed on a server in cluster mode, or one whose mode cannot be read (see
        the module's doc); with allow_cluster the store opens, and the verdict says so."""
        d = self._durability
        if d["cluster"] == "off":
            return
        why = (
            "the server runs in cluster mode"
            if d["cluster"] == "on"
            else "cluster mode cannot be ruled out (INFO cluster and CLUSTER MYID refused)"
        ) + (
            ": while the prefix's hash slot migrates a step can apply in part, and a record "
            "lost so lets an effect run twice"
        )
        if self.allow_cluster:
            self._cluster_warning = (
                f"CLUSTER {d['cluster'].upper()} (opened with allow_cluster): {why}; never "
                f"migrate the slot of {self._p} while a store runs. "
            )
            d["verdict"] = self._cluster_warning + d["verdict"]
            return
        raise StoreUnavailable(
            f"refusing to open the Redis store at {mask_url(self._url)}: {why}. Use a "
            "standalone master (Sentinel for failover), or give allow_cluster=true to "
            "accept that risk",
            operation="open",
            retryable=False,
            recover="point the store at a standalone Redis master (cluster-enabled no)"
            + ("" if d["cluster"] == "on" else ", and let its user run INFO cluster"),
            setting="cluster",
            cluster=d["cluster"],
        )

    def _refuse_eviction(self) -> None:
        """Fail closed where Redis may evict the fence's keys: an evicted record admits a
        second caller, an evicted token counter restarts tokens under a stale holder. With
        allow_eviction the store opens, and the verdict says so first."""
        d = self._durability
        why = self._eviction_risk(d)
        if why is None:
            return
        if self.allow_eviction:
            d["verdict"] = (
                f"EVICTION {d['eviction'].upper()} (opened with allow_eviction): {why}; not "
                f"safe for effects that move money. {d['verdict']}"
            )
            return
        raise StoreUnavailable(
            f"refusing to open the Redis store at {mask_url(self._url)}: {why}. Set "
            "maxmemory-policy noeviction (or maxmemory 0) on the server, or give "
            "allow_eviction=true to accept that risk",
            operation="open",
            retryable=False,
            recover="set maxmemory-policy noeviction (or maxmemory 0) on the Redis server",
            setting="maxmemory-policy",
            maxmemory=d["maxmemory"],
            maxmemory_policy=d["maxmemory_policy"],
        )

    def durability(self) -> dict[str, Any]:
        """The persistence and eviction settings read at connect, and what they mean."""
        return dict(self._durability)

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "store": self.name,
            "url": mask_url(self._url),
            "prefix": self.prefix,
            "schema_version": SCHEMA_VERSION,
            "ticket_scope": self.ticket_scope,
            "certs_per_domain": self.certs_per_domain,
            "durability": self.durability(),
        }
        if self._durability["eviction"] != "off" or self._durability["cluster"] != "off":
            out["warning"] = self._durability["verdict"]  # opened only when allowed: say so
        return out

    # -- calls --------------------------------------------------------------------------------
    def _t(self) -> str:
        return "" if self._clock is None else _num(self._clock())

    def _unavailable(self, op: str, exc: BaseException | str) -> StoreUnavailable:
        return StoreUnavailable(
            f"the Redis store {self.prefix!r} failed during {op}: {exc}; nothing was decided",
            operation=op,
        )

    def _refusal(self, op: str, said: str) -> StoreUnavailable:
        """The server refused the command before running it: nothing applied, so the
        driver's retries (and, after a commit, its abort) can act on it."""
        moved = said.startswith(("MOVED ", "ASK "))
        return StoreUnavailable(
            f"the Redis store {self.prefix!r} refused {op}: the server answered {said!r}; "
            "nothing was applied",
            recover=_redirected(said) if moved else None,
            operation=op,
            server_reply=said,
        )

    def _call(self, op: str, script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """One script. StoreUnavailable when closed or the server refused it before running;
        :class:`_Lost` when the connection broke (it may have run); any other error reply
        (a script error) as redis-py raised it."""
        if self._closed:
            raise StoreUnavailable(f"the Redis store {self.prefix!r} is closed", operation=op)
        try:
            return script(keys=keys, args=[self._p, *args])
        except (*_LOST, redis.exceptions.ResponseError) as exc:
            said = _refused(exc)  # before _LOST: LOADING is a ConnectionError, yet ran nothing
            if said is not None:
                raise self._refusal(op, said) from exc
            if isinstance(exc, _LOST):
                raise _Lost(str(exc)) from exc
            raise

    def _read(self, op: str, script: Any, keys: Sequence[str], args: Sequence[Any]) -> Any:
        """A read changes nothing: a broken connection is retried once on another."""
        for attempt in (0, 1):
            try:
                return self._call(op, script, keys, args)
            except _Lost as exc:
                if attempt:
                    raise self._unavailable(op, exc) from exc
        raise AssertionError("unreachable")

    def _cmd(self, op: str, fn: Callable[[], Any]) -> Any:
        """A plain read command, retried once on a broken connection."""
        if self._closed:
            raise StoreUnavailable(f"the Redis store {self.prefix!r} is closed", operation=op)
        for attempt in (0, 1):
            try:
                return fn()
            except (*_LOST, redis.exceptions.ResponseError) as exc:
                said = _refused(exc)
                if said is not None:
                    raise self._refusal(op, said) from exc
                if not isinstance(exc, _LOST):
                    raise
                if attempt:
                    raise self._unavailable(op, exc) from exc
        raise AssertionError("unreachable")

    def _k(self, kind: str, name: str) -> str:
        return f"{self._p}:{kind}:{name}"

    # -- records ------------------------------------------------------------------------------
    def _cert(self, data: bytes) -> Any:
        return self._certs.decode(data)

    def _decode(self, intent: str, f: Sequence[Any]) -> IntentRecord | None:
        """A record from its hash fields in :data:`_FIELDS` order (state None: no record)."""
        if f is None or not f or f[0] is None:
            return None
        (state, token, fp, domain, agent, lease_until, cert, until, reason, since, seq,
         reclaim_at) = f  # fmt: skip
        return IntentRecord(
            intent,
            _STATES[state.decode()],
            int(token),
            bytes(fp),
            domain.decode(),
            agent.decode(),
            _deadline(lease_until),
            self._cert(cert) if cert else None,
            _deadline(until),
            reason.decode(),
            float(since),
            int(seq),
            _deadline(reclaim_at),
        )

    # -- reads --------------------------------------------------------------------------------
    def now(self) -> float:
        if self._clock is not None:
            return float(self._clock())
        return float(self._read("now", self._s_now, (), ("",)))

    def get(self, intent: str) -> IntentRecord | None:
        key = self._k("i", intent)
        return self._decode(intent, self._cmd("get", lambda: self._r.hmget(key, _FIELDS)))

    def read(self, intent: str) -> tuple[IntentRecord | None, float]:
        """The record and the server's TIME in one script: a replay is one round trip."""
        now, fields = self._read("read", self._s_read, (self._k("i", intent),), (self._t(),))
        return self._decode(intent, fields), float(now)

    def current(self, domain: str) -> int:
        keys = (self._k("d", domain), f"{self._p}:fence")
        return int(self._read("current", self._s_current, keys, ("", domain)))

    def in_flight(self, domain: str) -> int:
        return int(
            self._read("in_flight", self._s_in_flight, (self._k("fl", domain),), ("", domain))
        )

    def _scan(self, kind: str) -> Iterator[bytes]:
        pattern = f"{self._p}:{kind}:*".replace("[", "\\[").replace("?", "\\?")
        pattern = pattern.replace("{", "[{]").replace("}", "[}]")
        yield from self._r.scan_iter(match=pattern, count=1000)

    def size(self) -> dict[str, int]:
        """Records by a SCAN of the prefix (O(keys): for operators and tests), domains and
        heads from the domain set."""

        def count() -> dict[str, int]:
            records = sum(1 for _ in self._scan("i"))
            domains = [_text(d) for d in self._r.smembers(f"{self._p}:domains")]
            pipe = self._r.pipeline(transaction=False)
            for d in domains:
                pipe.hexists(self._k("d", d), "head")
            heads = sum(1 for h in pipe.execute() if h)
            return {"records": records, "domains": len(domains), "heads": heads}

        out: dict[str, int] = self._cmd("size", count)
        return out

    def records(
        self, *, states: Sequence[State] = (), domain: str | None = None, limit: int = 1000
    ) -> Iterator[IntentRecord]:
        """A SCAN of the prefix, sorted by intent (O(keys): for operators)."""

        if limit <= 0:
            return  # as every store: none (the first match was listed before the check)

        def fetch() -> list[IntentRecord]:
            cut = len(self._p) + 3
            names = sorted(k[cut:].decode() for k in self._scan("i"))
            pipe = self._r.pipeline(transaction=False)
            for name in names:
                pipe.hmget(self._k("i", name), _FIELDS)
            out = []
            for name, fields in zip(names, pipe.execute(), strict=True):
                rec = self._decode(name, fields)
                if rec is None:
                    continue  # expired between the scan and the read
                if (not states or rec.state in states) and (domain is None or rec.domain == domain):
                    out.append(rec)
                    if len(out) >= limit:
                        break
            return out

        got: list[IntentRecord] = self._cmd("records", fetch)
        yield from got

    def certs(self, domain: str, *, after_seq: int = 0, limit: int = 1000) -> Iterator[Any]:
        """Committed certificates of ``domain`` after ``after_seq``, in seq order."""
        key = self._k("c", domain)
        rows = self._cmd(
            "certs",
            lambda: self._r.zrangebyscore(key, f"({after_seq}", "+inf", start=0, num=max(0, limit)),
        )
        for data in rows:
            yield cert_from_json(data)

    def trail_cut(self, domain: str) -> int:
        key = f"{self._p}:cuts"
        got = self._cmd("trail_cut", lambda: self._r.hget(key, domain))
        return 0 if got is None else int(got)

    def sealing_key(self) -> bytes:
        """Kept in the prefix's meta hash (the first one made wins): every process sharing
        the store seals and opens tickets with the same key. Made by a script that checks
        the role first (:data:`_SEALING_KEY`); read or made, it is safe to run again."""
        if self._key is None:
            got = self._read(
                "sealing_key",
                self._s_sealing_key,
                (f"{self._p}:meta",),
                ("", secrets.token_hex(32)),
            )
            self._key = bytes.fromhex(_text(got))
        return self._key

    # -- steps --------------------------------------------------------------------------------
    def claim(
        self,
        intent: str,
        *,
        expect: IntentRecord | None,
        fingerprint: bytes,
        domain: str,
        agent: str,
        lease_ttl: float,
        reclaim_after: float,
        compare: Sequence[tuple[str, int]],
        reserve_at: int | None,
    ) -> Step:
        self._recheck_eviction()
        if self._demoted is not None:
            raise StoreUnavailable(
                f"can't claim {intent!r} on the Redis store at {mask_url(self._url)}: since it "
                f"was opened, {self._demoted}. Nothing was decided",
                operation="claim",
                recover="point the store's URL at the Redis master, then retry",
                setting="role",
                role=self._durability["role"],
            )
        if self._evicting is not None:
            settings = self._durability
            raise StoreUnavailable(
                f"can't claim {intent!r} on the Redis store at {mask_url(self._url)}: since it "
                f"was opened, the server's settings changed: {self._evicting}. Nothing was "
                "decided. Set maxmemory-policy noeviction (or maxmemory 0) on the server",
                operation="claim",
                recover="set maxmemory-policy noeviction (or maxmemory 0) on the Redis server, "
                "then retry",
                setting="maxmemory-policy",
                maxmemory=settings["maxmemory"],
                maxmemory_policy=settings["maxmemory_policy"],
            )
        args: list[Any] = [self._t(), intent]
        if expect is None:
            args += ["0", "0", "", "0", "0"]
        else:
            args += ["1", expect.token, expect.state.value, _num(expect.lease_until),
                     _num(expect.until)]  # fmt: skip
        args += [bytes(fingerprint), domain, agent, _num(lease_ttl), _num(reclaim_after)]
        args.append("" if reserve_at is None else reserve_at)
        for d, s in compare:
            args += [d, s]
        keys = (
            self._k("i", intent),
            self._k("d", domain),
            f"{self._p}:tokens",
            self._k("fl", domain),
            f"{self._p}:domains",
        )
        try:
            out = self._call("claim", self._s_claim, keys, args)
        except _Lost as exc:
            # the claim may have applied and lost its reply; its lease lapses like a crashed
            # holder's, and this caller runs nothing; a finished record is an answer
            if expect is None:
                finished = self.finished_after_lost_claim(intent)
                if finished is not None:
                    return finished
            raise self._unavailable("claim", exc) from exc
        outcome = out[0]
        found = self._decode(intent, out[1])
        now = float(out[4])
        if outcome == b"moved":
            return Step(MOVED, found=found, now=now)
        if outcome in (b"stale", b"race"):
            d, want, got = out[7]
            stale = (d.decode(), int(want), int(got))
            kind = STALE if outcome == b"stale" else RACE
            return Step(kind, found=found, stale=stale, now=now)
        token, seq = int(out[2]), int(out[3])
        rec = IntentRecord(
            intent,
            State.IN_FLIGHT,
            token,
            fingerprint,
            domain,
            agent,
            _deadline(min(now + lease_ttl, NEVER)),
            None,
            0.0,
            "",
            0.0,
            seq,
            _deadline(min(now + reclaim_after, NEVER)),
        )
        head = EMPTY_HEAD if out[5] is None else Head(out[5].decode(), json.loads(out[6]))
        return Step(APPLIED, rec, found, head, now=now)

    def complete(
        self,
        intent: str,
        token: int,
        cert: Any,
        *,
        fingerprint: bytes,
        result_ttl: float,
        reclaim_after: float,
        compare: Sequence[tuple[str, int]],
        own_seq: int | None,
        stale_reason: str,
        stale_reclaim_after: float,
    ) -> Step:
        cert_json = cert_to_json(cert)
        self._certs.keep(cert_json, cert)  # the first replay here decodes nothing
        args: list[Any] = [
            self._t(),
            intent,
            token,
            cert_json,
            cert.hash,
            json.dumps(cert.vector_clock, separators=(",", ":")),
            _num(result_ttl),
            _num(reclaim_after),
            "" if own_seq is None else own_seq,
            stale_reason,
            _num(stale_reclaim_after),
            "" if self.certs_per_domain is None else self.certs_per_domain,
            bytes(fingerprint),
        ]
        for d, s in compare:
            args += [d, s]
        keys = (self._k("i", intent),)

        def answer(out: Any) -> Step:
            outcome = out[0]
            cur = self._decode(intent, out[1])
            if outcome == b"moved":
                return Step(MOVED, found=cur)
            assert cur is not None
            now = float(out[2])
            if outcome == b"stale":
                d, want, got = out[3]
                rec = IntentRecord(
                    intent,
                    State.FAILED,
                    token,
                    cur.fingerprint,
                    cur.domain,
                    cur.agent,
                    reason=stale_reason,
                    since=now,
                    seq=cur.seq,
                    reclaim_at=_deadline(min(now + stale_reclaim_after, NEVER)),
                )
                return Step(STALE, rec, cur, stale=(d.decode(), int(want), int(got)))
            rec = IntentRecord(
                intent,
                State.DONE,
                token,
                cur.fingerprint,
                cur.domain,
                cur.agent,
                0.0,
                cert,
                _deadline(min(now + result_ttl, NEVER)),
                "",
                0.0,
                cur.seq,
                _deadline(min(now + reclaim_after, NEVER)),
            )
            return Step(APPLIED, rec, cur)

        return self._step(
            "complete",
            intent,
            token,
            lambda: answer(self._call("complete", self._s_complete, keys, args)),
            lambda r: (
                r is not None
                and r.state is State.DONE
                and getattr(r.cert, "hash", None) == cert.hash
            ),
        )

    def _step(
        self,
        op: str,
        intent: str,
        token: int,
        run: Callable[[], Step],
        applied: Callable[[IntentRecord | None], bool],
    ) -> Step:
        """A ticket step; if the connection broke while it ran, answer from the store:

        - the record shows this step's result under this token: APPLIED (only the reply
          was lost);
        - still in flight under this token: it did not apply: run it once more (its own
          compare-by-token makes that safe; a second loss is reported unavailable);
        - anything else: MOVED with what is there. Never an answer the store does not hold.
        """
        try:
            return run()
        except _Lost as exc:
            try:
                rec = self.get(intent)
            except StoreUnavailable as again:
                raise self._unavailable(op, again) from exc
            if rec is not None and rec.token == token and applied(rec):
                return Step(APPLIED, rec, None)
            if rec is None and applied(None):
                return Step(APPLIED, None, None)
            if rec is not None and rec.token == token and rec.state is State.IN_FLIGHT:
                try:
                    step = run()
                except _Lost as lost:
                    raise self._unavailable(op, lost) from exc
                return settled(step, lambda r: applied(r) and (r is None or r.token == token))
            if rec is not None and applied(None):  # a release: see release_untold
                raise release_untold(f"the Redis store {self.prefix!r}", intent, rec.token) from exc
            return Step(MOVED, found=rec)

    def _finish(
        self,
        kind: str,
        intent: str,
        token: int,
        reason: str,
        lease_ttl: float,
        reclaim_after: float,
        applied: Callable[[IntentRecord | None], bool],
    ) -> Step:
        keys = (self._k("i", intent),)
        args = [self._t(), intent, token, kind, reason, _num(lease_ttl), _num(reclaim_after)]

        def run() -> Step:
            out = self._call(kind, self._s_finish, keys, args)
            cur = self._decode(intent, out[1])
            if out[0] == b"moved":
                return Step(MOVED, found=cur)
            assert cur is not None
            now = float(out[2])
            if kind == "release":
                return Step(APPLIED, None, cur)
            if kind == "fail":
                rec = IntentRecord(
                    intent,
                    State.FAILED,
                    token,
                    cur.fingerprint,
                    cur.domain,
                    cur.agent,
                    reason=reason,
                    since=now,
                    seq=cur.seq,
                    reclaim_at=_deadline(min(now + reclaim_after, NEVER)),
                )
                return Step(APPLIED, rec, cur)
            rec = IntentRecord(
                intent,
                State.IN_FLIGHT,
                token,
                cur.fingerprint,
                cur.domain,
                cur.agent,
                lease_until=_deadline(min(now + lease_ttl, NEVER)),
                seq=cur.seq,
                reclaim_at=_deadline(min(now + reclaim_after, NEVER)),
            )
            return Step(APPLIED, rec, cur)

        return self._step(kind, intent, token, run, applied)

    def fail(self, intent: str, token: int, reason: str, *, reclaim_after: float) -> Step:
        return self._finish(
            "fail",
            intent,
            token,
            reason,
            0.0,
            reclaim_after,
            lambda r: r is not None and r.state is State.FAILED and r.reason == reason,
        )

    def release(self, intent: str, token: int) -> Step:
        # a lost reply and no record: released (or cleared since): the intent is free
        return self._finish("release", intent, token, "", 0.0, 0.0, lambda r: r is None)

    def renew(self, intent: str, token: int, *, lease_ttl: float, reclaim_after: float) -> Step:
        # a lost reply: renewing again is harmless, so "in flight under this token" retries
        return self._finish("renew", intent, token, "", lease_ttl, reclaim_after, lambda r: False)

    def clear(self, intent: str) -> IntentRecord | None:
        try:
            out = self._call("clear", self._s_clear, (self._k("i", intent),), ("", intent))
        except _Lost as exc:
            raise self._unavailable("clear", exc) from exc
        return None if out is None else self._decode(intent, out)

    def clear_if(self, intent: str, *, expect: IntentRecord, entry: Mapping[str, Any]) -> Step:
        data = entry_to_json(entry)
        keys = (self._k("i", intent), f"{self._p}:audit", f"{self._p}:audit_id")
        args = [self._t(), intent, expect.token, expect.state.value,
                _num(expect.lease_until), _num(expect.until), data]  # fmt: skip
        try:
            out = self._call("clear", self._s_clear_if, keys, args)
        except _Lost as exc:
            # it may have applied: the operator looks again rather than being told a guess
            raise self._unavailable("clear", exc) from exc
        found = self._decode(intent, out[1]) if out[1] else None
        if out[0] == b"moved":
            return Step(MOVED, found=found)
        return Step(APPLIED, None, found, entry=entry_from_json(data, int(out[2]), float(out[3])))

    def audit(
        self, *, intent: str | None = None, after: int | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        """Entries by id from the audit zset; filtering by intent reads the whole trail
        (O(clears): operators clear rarely)."""
        key = f"{self._p}:audit"
        n = max(0, int(limit))
        if not n:
            return []

        def fetch() -> list[Any]:
            if intent is not None:
                lo = "-inf" if after is None else f"({int(after)}"
                return list(self._r.zrangebyscore(key, lo, "+inf"))
            if after is not None:
                return list(self._r.zrangebyscore(key, f"({int(after)}", "+inf", start=0, num=n))
            return list(reversed(self._r.zrevrange(key, 0, n - 1)))

        out = []
        for member in self._cmd("audit", fetch):
            i, at, name, data = json.loads(member)
            if intent is None or name == intent:
                out.append(entry_from_json(data, int(i), float(at)))
        if intent is not None:
            out = out[:n] if after is not None else out[max(0, len(out) - n) :]
        return out

    def evict_domain(self, domain: str) -> Step:
        keys = (
            self._k("d", domain),
            self._k("fl", domain),
            f"{self._p}:fence",
            f"{self._p}:domains",
        )
        try:
            outcome, n = self._call("evict_domain", self._s_evict, keys, ("", domain))
        except _Lost as exc:
            raise self._unavailable("evict_domain", exc) from exc
        if outcome == b"busy":
            return Step(BUSY, count=int(n))
        return Step(APPLIED, value=None if n is None else int(n))

    def sweep(self, limit: int | None = None) -> int:
        """Clean the reclaim index: delete due records that key expiry has not removed yet
        (all of them under a test clock, where TTLs are off), and drop index entries of
        records already gone. Returns how many records it deleted, which in production is
        often 0: Redis expired them first."""
        total = 0
        visited = 0
        while True:
            batch = 1000 if limit is None else min(1000, limit - visited)
            if batch <= 0:
                return total
            try:
                n, seen = self._call(
                    "sweep", self._s_sweep, (f"{self._p}:reclaim",), (self._t(), batch)
                )
            except _Lost as exc:
                raise self._unavailable("sweep", exc) from exc
            total += int(n)
            visited += int(seen)
            if seen < batch:
                return total

    # -- waiting ------------------------------------------------------------------------------
    def _listening(self) -> bool:
        """Whether the listener's SUBSCRIBE is confirmed; starts a listener if none runs.

        Live only once the server confirmed the subscription: a PUBLISH before that is not
        delivered, and a waiter told "live" then would sleep through the change it waits for
        (found by review). The thread subscribes on its own, so no waiter waits on a
        connect; until it is live, waiters poll."""
        listener = self._listener
        if listener is not None and listener.is_alive():
            return self._live
        with self._listener_lock:
            if self._closed:
                return False
            if self._listener is not None and self._listener.is_alive():
                return self._live
            now = time.monotonic()
            if now < self._relisten_at:
                return False
            self._relisten_at = now + _RELISTEN
            self._live = False
            self._listener = threading.Thread(
                target=self._listen, name="effectfence-redis-listen", daemon=True
            )
            self._listener.start()
            return False

    def _listen(self) -> None:
        channel = f"{self._p}:changes".encode()
        ps: Any = None
        try:
            # through Any: redis-py 8.1 leaves pubsub() untyped and later releases type it,
            # so an ignore here failed mypy on one or the other
            client: Any = self._r
            ps = client.pubsub()
            ps.subscribe(channel)
            while not self._closed:
                msg = ps.get_message(timeout=0.25)
                if msg is None:
                    continue
                kind = msg.get("type")
                if kind == "message":
                    self._waiters.wake(msg["data"].decode())
                elif kind == "subscribe" and msg.get("channel") == channel:
                    self._live = True
                    self._waiters.wake_all()  # anything may have changed before it
        except (*_LOST, redis.exceptions.RedisError):
            pass  # the next waiter starts a new listener
        finally:
            self._live = False
            if ps is not None:
                with contextlib.suppress(Exception):
                    ps.close()

    def wait_for_change(self, intent: str, seen: IntentRecord | None, timeout: float) -> bool:
        """Woken by the PUBLISH of the intent's next transition in any process."""
        return self._waiters.wait(intent, seen, timeout, lambda: self.get(intent), self._listening)

    # -- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        listener = getattr(self, "_listener", None)
        if listener is not None:
            listener.join(timeout=2.0)
        if getattr(self, "_own_client", False):
            conns = getattr(self, "_conns", None)
            if conns is not None:
                conns.close()
            with contextlib.suppress(Exception):
                self._r.close()

"""The PostgreSQL store: one schema shared by every process on every host that can reach it.

It decides nothing (the rules are in :mod:`effectfence.protocol`): each step of
:mod:`effectfence.store.base` is ONE statement, ``SELECT * FROM <schema>.<step>(...)``, a
PL/pgSQL function whose conditions are the plain comparisons the decider chose. A statement
in autocommit is one transaction: a connection cut at any instant leaves all of the step or
none of it, and each step costs one round trip.

Design
------
- Tables (in the store's schema, ``?schema=name``, default ``effectfence``): ``intents``
  (one row per record, codec columns), ``domains`` (seq and head per domain), ``fence``
  (one row: the eviction floor), ``certs`` (append-only audit trail, written by the same
  statement as the commit), ``audit`` (operator clears, written by the clearing statement),
  ``meta`` (schema version, store id, sealing key), ``watch`` (intents a waiter is blocked
  on). Fencing tokens come from a sequence, drawn once the claim holds the slot. Created
  on first use, under an advisory lock; versioned.
- Locks, always in this order: the intent's row (``FOR UPDATE``; a claim of an empty slot
  inserts it, first), then domain rows in name order (the claim's read set ``FOR SHARE``,
  its own domain ``FOR NO KEY UPDATE``), then the ``fence`` row (only to create a domain,
  or to evict one). One order, no deadlock between steps; ``evict_domain`` takes the fence
  row first and may meet a claim's read-set lock the other way round, so a deadlock (or
  serialization) abort, which applied nothing, is retried.
- Time: ``clock_timestamp()``, read inside the step after its locks are held (a claim of
  an empty slot sets its lease again once it holds them); never a client's clock.
  ``clock=`` replaces it with a parameter of every statement: it exists for tests (a fake
  clock drives leases without sleeping), never for production.
- Sweeps cost O(expired): a partial index on ``reclaim_at`` holds only finite deadlines.
- ``wait_for_change``: waiters ``LISTEN`` on one dedicated connection per store object and
  register the intent in ``watch``, in the statement that reads it (``watch_``, which
  waits for a held row no longer than the waiter's own time left); a
  transition of a registered intent ``NOTIFY``s the schema's channel with its md5 and spends
  the registration (``changed_``). A NOTIFY takes a database-wide lock at commit, so steps
  nobody waits for, nearly all of them, send none.
- Durability: every statement commits with ``synchronous_commit`` on. A session found with
  it off (server or role default) is switched on, and :meth:`PostgresStore.describe` says so.
  Isolation: every step runs READ COMMITTED, whatever the database's or role's default
  (:data:`_PIN`, on connecting; on every borrow of a caller's pooled connection).

Errors: a connection that cannot be had, or a step the server refused before it applied,
raises :class:`~effectfence.errors.StoreUnavailable` ("nothing was decided"). A connection
lost while a step ran may have lost only the reply: ticket steps then re-read the record and
answer from what the store holds (see :meth:`PostgresStore._reconcile`), a claim answers
unavailable (a lease it may have taken lapses like a crashed holder's).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import re
import secrets
import select
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import psycopg
import psycopg.errors
import psycopg_pool
from psycopg import pq, sql
from psycopg.conninfo import conninfo_to_dict

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

__all__ = ["DEFAULT_SCHEMA", "SCHEMA_VERSION", "PostgresStore", "StoreSchemaError"]

#: the schema this code writes; a schema with a newer version is refused, never half-read.
#: 2: the ``audit`` table and ``clear_if`` (an older schema gains them when next opened)
#: 3: ``complete`` compares the ticket's fingerprint with its token (the fence commits
#: without reading first)
#: 4: the version-2 ``complete`` stays, as a shim over the new one: a process still running
#: version-2 code when the schema is upgraded can commit what it holds (without it, its
#: effect ran, its commit failed, and the lapsed lease was taken over: a double execution)
#: 5: ``watch``: a transition notifies only when a waiter registered for the intent (a NOTIFY
#: takes a database-wide lock at commit, serializing every step that sends one)
#: 6: a ``claim`` expecting an empty slot reads a record it finds without locking it, and
#: every outcome carries the server's clock, so prepare claims first (``put_first``). Older
#: code calls ``claim`` only after reading, and reads its answers as before
#: 7: ``trail_cuts``, and ``sweep`` deletes certificates only as a prefix of each trail
#: (a hole made a sound trail fail its check); ``merge_`` bounds a head clock
#: (clock.MAX_HEAD_AGENTS). Older code runs on with the new functions
#: 8: ``merge_`` keeps clock.HEAD_AGENTS_KEPT past the bound; ``sweep`` reads only what may
#: go, one sweeper at a time, a bounded batch, without JIT. (Functions change only with a
#: new version: the DDL runs only on a schema older than this code's; found by review)
#: 9: ``lock_domains_`` also locks each domain by name, so read sets on domains that have
#: no row yet are serialized (two claims reading each other's new domain both ran)
#: 10: a ``claim`` of an empty slot sets its lease once its locks are held (one judged
#: before its waits was handed out already over); ``clear_if`` draws audit ids one clear
#: at a time, so their order is commit order (found by review)
#: 11: ``watch_(intent, wait_ms)`` waits for a held row only for the waiter's time left
#: (version 10's waited for ever, past the waiter's lease: found by review); version-10
#: code keeps its one-argument ``watch_``
SCHEMA_VERSION = 11
DEFAULT_SCHEMA = "effectfence"
DEFAULT_POOL_MAX = 8
#: seconds to wait for a pooled connection (or a new one) before reporting unavailable
DEFAULT_TIMEOUT = 10.0
_CERT_CACHE = 4096
_SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,40}$")
_STATES = {s.value: s for s in State}
_F = ", ".join(RECORD_FIELDS)
#: the record columns a step function returns for the record it found (intent is known)
_FOUND = RECORD_FIELDS[1:]
#: deadlock or serialization failure: the transaction was rolled back, safe to run again
_RETRY_SQLSTATES = {"40P01", "40001"}
#: the server refused the statement, whose transaction it rolled back, so nothing applied:
#: read-only (a standby after a failover or switchover, default_transaction_read_only),
#: lock or object busy, and the classes insufficient resources (53: disk full, out of
#: memory, too many connections), operator intervention (57: cancel, statement timeout,
#: shutdown, starting up) and system error (58: I/O). psycopg raises some of these as
#: InternalError or NotSupportedError, which escaped untyped (found by review)
_REFUSED_SQLSTATES = frozenset({"25006", "55P03", "55006"})
_REFUSED_CLASSES = ("53", "57", "58")
_TUPLES_OK = pq.ExecStatus.TUPLES_OK
_MAX_RETRIES = 5
#: lock_timeout is an int of milliseconds (about 24 days)
_MAX_LOCK_WAIT_MS = 2**31 - 1
#: a listener whose connect failed is started again at most this often (waiters poll)
_RELISTEN = 1.0

# Every step function: {s} is the quoted schema, {ch} the NOTIFY channel (a literal).
# ``now`` is the server's clock_timestamp() unless a test passes p_now.
_DDL = """
CREATE SCHEMA IF NOT EXISTS {s};
CREATE TABLE IF NOT EXISTS {s}.meta (key text PRIMARY KEY, value text NOT NULL);
CREATE TABLE IF NOT EXISTS {s}.fence (
    id int PRIMARY KEY CHECK (id = 0),
    floor bigint NOT NULL              -- where new domains start (raised by evictions, G5)
);
INSERT INTO {s}.fence (id, floor) VALUES (0, 0) ON CONFLICT DO NOTHING;
CREATE SEQUENCE IF NOT EXISTS {s}.tokens;
CREATE TABLE IF NOT EXISTS {s}.intents (
    intent text PRIMARY KEY,
    state text NOT NULL,
    token bigint NOT NULL,
    fingerprint bytea NOT NULL,
    domain text NOT NULL,
    agent text NOT NULL,
    lease_until float8 NOT NULL,
    cert bytea,
    until float8 NOT NULL,
    reason text NOT NULL,
    since float8 NOT NULL,
    seq bigint NOT NULL,
    reclaim_at float8 NOT NULL
);
-- partial: only records a sweep will reclaim are indexed, so a sweep reads O(expired)
CREATE INDEX IF NOT EXISTS intents_reclaim ON {s}.intents (reclaim_at) WHERE reclaim_at < 1e300;
CREATE INDEX IF NOT EXISTS intents_in_flight ON {s}.intents (domain) WHERE state = 'in_flight';
CREATE TABLE IF NOT EXISTS {s}.domains (
    domain text PRIMARY KEY,
    seq bigint NOT NULL,
    head text,                         -- hash of the last committed certificate
    clock jsonb                        -- merged vector clock of the commits
);
CREATE TABLE IF NOT EXISTS {s}.certs (
    domain text NOT NULL,
    seq bigint NOT NULL,
    hash text NOT NULL,
    cert bytea NOT NULL,
    committed_at float8 NOT NULL,
    keep_until float8 NOT NULL,
    PRIMARY KEY (domain, seq)
);
CREATE INDEX IF NOT EXISTS certs_keep ON {s}.certs (keep_until) WHERE keep_until < 1e300;
-- the operator's audit trail: who cleared what and why, written by the statement that
-- cleared it (schema version 2); kept forever, clears are rare
CREATE TABLE IF NOT EXISTS {s}.audit (
    id bigserial PRIMARY KEY,
    intent text NOT NULL,
    at float8 NOT NULL,
    entry text NOT NULL                -- JSON (codec.entry_to_json)
);
CREATE INDEX IF NOT EXISTS audit_intent ON {s}.audit (intent, id);

-- the intents a waiter in some process is blocked on (see changed_ and watch_)
CREATE TABLE IF NOT EXISTS {s}.watch (intent text PRIMARY KEY);
-- where retention cut each domain's trail: every certificate with seq <= through is gone
CREATE TABLE IF NOT EXISTS {s}.trail_cuts (domain text PRIMARY KEY, through bigint NOT NULL);

CREATE OR REPLACE FUNCTION {s}.now_(p_now float8) RETURNS float8 LANGUAGE sql VOLATILE AS $$
    SELECT coalesce(p_now, extract(epoch FROM clock_timestamp())::float8) $$;

-- a deadline as stored: "never" is 1e300 (codec.NEVER)
CREATE OR REPLACE FUNCTION {s}.deadline_(t float8) RETURNS float8 LANGUAGE sql IMMUTABLE AS $$
    SELECT least(t, 1e300::float8) $$;

-- a domain's head clock after a commit (clock.merge_head): the element-wise maximum; past
-- {max_head} agents, the {kept_head} with the most events (ties: the smaller name, in code
-- point order as Python's). PL/pgSQL, not SQL: a SQL function that is not inlined is
-- planned again at every call (~0.25 ms, measured)
CREATE OR REPLACE FUNCTION {s}.merge_(a jsonb, b jsonb) RETURNS jsonb LANGUAGE plpgsql IMMUTABLE
AS $$
DECLARE k text; v jsonb; r jsonb := coalesce(a, '{{}}'::jsonb);
BEGIN
    FOR k, v IN SELECT * FROM jsonb_each(coalesce(b, '{{}}'::jsonb)) LOOP
        IF NOT r ? k OR (r -> k)::numeric < v::numeric THEN
            r := r || jsonb_build_object(k, v);
        END IF;
    END LOOP;
    IF (SELECT count(*) FROM jsonb_object_keys(r)) > {max_head} THEN
        SELECT jsonb_object_agg(e.key, e.value) INTO r FROM (
            SELECT key, value FROM jsonb_each(r)
             ORDER BY value::numeric DESC, key COLLATE "C" LIMIT {kept_head}) e;
    END IF;
    RETURN r;
END $$;

-- a domain's seq; an absent domain is at the floor
CREATE OR REPLACE FUNCTION {s}.at_(p_domain text) RETURNS bigint LANGUAGE sql STABLE AS $$
    SELECT coalesce((SELECT seq FROM {s}.domains WHERE domain = p_domain),
                    (SELECT floor FROM {s}.fence WHERE id = 0)) $$;

-- lock a step's domains in name order: its own exclusively, the others shared. A row lock
-- alone locks nothing where a domain has no row yet: two claims whose read sets named each
-- other's new domain both passed their compare, and both ran (found by review: write skew,
-- G6). So each domain is also locked by name (an advisory lock on a hash of schema and
-- name, held to the end of the step), whether its row exists or not
CREATE OR REPLACE FUNCTION {s}.lock_domains_(p_own text, p_others text[])
RETURNS void LANGUAGE plpgsql AS $$
DECLARE d text;
BEGIN
    FOR d IN SELECT DISTINCT x FROM unnest(p_others || p_own) x ORDER BY x LOOP
        IF d = p_own THEN
            PERFORM pg_advisory_xact_lock(hashtextextended({sname} || d, 0));
            PERFORM 1 FROM {s}.domains WHERE domain = d FOR NO KEY UPDATE;
        ELSE
            PERFORM pg_advisory_xact_lock_shared(hashtextextended({sname} || d, 0));
            PERFORM 1 FROM {s}.domains WHERE domain = d FOR SHARE;
        END IF;
    END LOOP;
END $$;

-- the first compared (domain, seq) that does not hold, if any
CREATE OR REPLACE FUNCTION {s}.compare_(p_domains text[], p_seqs bigint[],
    OUT s_domain text, OUT s_want bigint, OUT s_got bigint)
LANGUAGE plpgsql AS $$
DECLARE i int; v bigint;
BEGIN
    FOR i IN 1 .. coalesce(array_length(p_domains, 1), 0) LOOP
        v := {s}.at_(p_domains[i]);
        IF v <> p_seqs[i] THEN
            s_domain := p_domains[i]; s_want := p_seqs[i]; s_got := v; RETURN;
        END IF;
    END LOOP;
END $$;

-- a step changed p_intent's record: wake its waiters, if it has any. A NOTIFY takes a
-- database-wide lock at commit, so a step no one waits for sends none.
CREATE OR REPLACE FUNCTION {s}.changed_(p_intent text) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM {s}.watch WHERE intent = p_intent;
    IF FOUND THEN PERFORM pg_notify({ch}, md5(p_intent)); END IF;
END $$;

-- a waiter registers, and reads the record, in one statement. FOR SHARE waits for a step
-- holding the row (FOR UPDATE) to commit, and then reads what it wrote; a step that comes
-- later sees the registration. Either way no transition is missed. It waits at most
-- p_wait_ms in all: the waiter's own time left, which the fence bounds by the lease; one
-- that runs out reads the row as committed, unregistered (its time is up: it reads again
-- and answers). Version 10's waited as long as the row was held: a waiter outlived its
-- lease. lock_timeout bounds each lock wait, not the statement: a step queued ahead of the
-- waiter took the row when its holder ended, and the waiter waited for it afresh (found by
-- review: 1.9 s on a 1 s wait), so the waits are slices of what is left.
CREATE OR REPLACE FUNCTION {s}.watch_(p_intent text, p_wait_ms integer)
RETURNS SETOF {s}.intents
LANGUAGE plpgsql AS $$
DECLARE
    cur {s}.intents%ROWTYPE;
    deadline timestamptz := clock_timestamp() + greatest(p_wait_ms, 1) * interval '1 ms';
    left_ms float8;
BEGIN
    LOOP
        left_ms := extract(epoch FROM deadline - clock_timestamp()) * 1000;
        IF left_ms < 1 THEN
            RETURN QUERY SELECT * FROM {s}.intents WHERE intent = p_intent;
            RETURN;
        END IF;
        PERFORM set_config('lock_timeout', floor(least(left_ms, 100))::bigint::text, true);
        BEGIN
            SELECT * INTO cur FROM {s}.intents WHERE intent = p_intent FOR SHARE;
            IF FOUND THEN
                INSERT INTO {s}.watch (intent) VALUES (p_intent) ON CONFLICT DO NOTHING;
                RETURN NEXT cur;
            END IF;
            RETURN;
        EXCEPTION WHEN lock_not_available THEN
            NULL;  -- the next slice, or the deadline
        END;
    END LOOP;
END $$;

-- version 10's, for its code still running after an upgrade: it waits as it did
CREATE OR REPLACE FUNCTION {s}.watch_(p_intent text) RETURNS SETOF {s}.intents
LANGUAGE sql AS $$ SELECT * FROM {s}.watch_(p_intent, 2147483647) $$;

CREATE OR REPLACE FUNCTION {s}.claim(
    p_intent text, p_expect boolean, p_token bigint, p_state text, p_lease_until float8,
    p_until float8, p_fp bytea, p_domain text, p_agent text, p_lease_ttl float8,
    p_reclaim_after float8, p_cmp_domains text[], p_cmp_seqs bigint[], p_reserve_at bigint,
    p_now float8,
    OUT outcome text, OUT f_state text, OUT f_token bigint, OUT f_fingerprint bytea,
    OUT f_domain text, OUT f_agent text, OUT f_lease_until float8, OUT f_cert bytea,
    OUT f_until float8, OUT f_reason text, OUT f_since float8, OUT f_seq bigint,
    OUT f_reclaim_at float8, OUT r_token bigint, OUT r_seq bigint, OUT r_now float8,
    OUT h_hash text, OUT h_clock jsonb, OUT s_domain text, OUT s_want bigint, OUT s_got bigint)
LANGUAGE plpgsql AS $$
DECLARE
    cur {s}.intents%ROWTYPE;
    have boolean;
    v_seq bigint;
    v_floor bigint;
    done boolean := false;
    first boolean := false;
BEGIN
    -- condition 1, slot: the record is the version the decider observed (base.same_record)
    IF NOT p_expect THEN
        -- an empty slot expected (prepare claims first): a record found is only read, not
        -- locked, and answered with the clock it is judged at; so finding one (a replay, a
        -- duplicate) writes nothing, costs no flush, and costs about what a read costs
        SELECT 'moved', i.state, i.token, i.fingerprint, i.domain, i.agent, i.lease_until,
               i.cert, i.until, i.reason, i.since, i.seq, i.reclaim_at, {s}.now_(p_now)
          INTO outcome, f_state, f_token, f_fingerprint, f_domain, f_agent, f_lease_until,
               f_cert, f_until, f_reason, f_since, f_seq, f_reclaim_at, r_now
          FROM {s}.intents i WHERE i.intent = p_intent;
        IF FOUND THEN RETURN; END IF;
        have := false;
        -- Take the slot before any domain. Every step that finds the record holds its row,
        -- then domains; a claim holding a domain while its insert waited on a commit of the
        -- same intent (a non-HOT update adds a key entry) deadlocked with that commit, and
        -- each deadlock cost a second. The token is drawn once the slot is held (at the
        -- end): an insert that waited for another claim of the intent, then for a clear of
        -- it, must not hand out a token drawn before that claim's (fencing tokens grow).
        -- Its lease is set again once the domains are held (at the end): one judged before
        -- the waits was handed out already over, and a duplicate took it over (found by
        -- review). A refusal below deletes the row.
        r_now := {s}.now_(p_now);
        INSERT INTO {s}.intents ({f}) VALUES (p_intent, 'in_flight', 0, p_fp,
            p_domain, p_agent, {s}.deadline_(r_now + p_lease_ttl), NULL, 0, '', 0, 0,
            {s}.deadline_(r_now + p_reclaim_after))
        ON CONFLICT (intent) DO NOTHING;
        IF NOT FOUND THEN  -- taken since: rolled back whole, reported MOVED
            RAISE EXCEPTION USING ERRCODE = 'EF001', MESSAGE = 'effectfence: slot taken';
        END IF;
        first := true;
    ELSE
        SELECT * INTO cur FROM {s}.intents WHERE intent = p_intent FOR UPDATE;
        have := FOUND;
        IF have THEN
            SELECT cur.state, cur.token, cur.fingerprint, cur.domain, cur.agent,
                   cur.lease_until, cur.cert, cur.until, cur.reason, cur.since, cur.seq,
                   cur.reclaim_at
              INTO f_state, f_token, f_fingerprint, f_domain, f_agent, f_lease_until, f_cert,
                   f_until, f_reason, f_since, f_seq, f_reclaim_at;
        END IF;
        IF NOT have OR NOT (cur.token = p_token AND cur.state = p_state
                AND cur.lease_until = p_lease_until AND cur.until = p_until) THEN
            -- judged by the decider at this clock (Step.now): no read of its own
            r_now := {s}.now_(p_now); outcome := 'moved'; RETURN;
        END IF;
    END IF;
    -- the read set's rows for share, the own domain's for update, in name order
    IF cardinality(p_cmp_domains) > 0 THEN
        PERFORM {s}.lock_domains_(p_domain, p_cmp_domains);
    END IF;
    -- condition 2, compare: every (domain, seq) of the read set holds
    IF cardinality(p_cmp_domains) > 0 THEN
        SELECT c.s_domain, c.s_want, c.s_got INTO s_domain, s_want, s_got
          FROM {s}.compare_(p_cmp_domains, p_cmp_seqs) c;
    END IF;
    IF s_domain IS NOT NULL THEN
        IF first THEN DELETE FROM {s}.intents WHERE intent = p_intent; END IF;
        r_now := {s}.now_(p_now); outcome := 'stale'; RETURN;
    END IF;
    -- condition 3, reserve: compare-exchange at p_reserve_at, else the next seq
    WHILE NOT done LOOP
        SELECT seq, head, clock INTO v_seq, h_hash, h_clock FROM {s}.domains
         WHERE domain = p_domain FOR NO KEY UPDATE;
        IF FOUND THEN
            IF p_reserve_at IS NOT NULL AND v_seq <> p_reserve_at THEN
                outcome := 'race'; s_domain := p_domain; s_want := p_reserve_at; s_got := v_seq;
                IF first THEN DELETE FROM {s}.intents WHERE intent = p_intent; END IF;
                r_now := {s}.now_(p_now); RETURN;
            END IF;
            UPDATE {s}.domains SET seq = v_seq + 1 WHERE domain = p_domain;
            r_seq := v_seq + 1; done := true;
        ELSE
            -- a new domain starts at the floor: hold the fence row so no eviction moves it
            SELECT floor INTO v_floor FROM {s}.fence WHERE id = 0 FOR SHARE;
            IF p_reserve_at IS NOT NULL AND v_floor <> p_reserve_at THEN
                -- lost without creating the domain (G7)
                outcome := 'race'; s_domain := p_domain; s_want := p_reserve_at; s_got := v_floor;
                IF first THEN DELETE FROM {s}.intents WHERE intent = p_intent; END IF;
                r_now := {s}.now_(p_now); RETURN;
            END IF;
            INSERT INTO {s}.domains (domain, seq) VALUES (p_domain, v_floor + 1)
                ON CONFLICT (domain) DO NOTHING;
            IF FOUND THEN
                r_seq := v_floor + 1; done := true;
            ELSE  -- created meanwhile by another claim: lock it and look again
                PERFORM 1 FROM {s}.domains WHERE domain = p_domain FOR NO KEY UPDATE;
            END IF;
        END IF;
    END LOOP;
    r_token := nextval('{s}.tokens');
    -- the lease starts now, every lock of the step held (its insert's clock was read before
    -- it waited for them)
    r_now := {s}.now_(p_now);
    IF first THEN  -- the slot is ours already: its token, seq and lease
        UPDATE {s}.intents SET token = r_token, seq = r_seq,
            lease_until = {s}.deadline_(r_now + p_lease_ttl),
            reclaim_at = {s}.deadline_(r_now + p_reclaim_after)
         WHERE intent = p_intent;
    ELSE  -- the record condition 1 found and holds (FOR UPDATE), taken over
        UPDATE {s}.intents SET state = 'in_flight', token = r_token, fingerprint = p_fp,
            domain = p_domain, agent = p_agent,
            lease_until = {s}.deadline_(r_now + p_lease_ttl), cert = NULL, until = 0,
            reason = '', since = 0, seq = r_seq,
            reclaim_at = {s}.deadline_(r_now + p_reclaim_after)
         WHERE intent = p_intent;
    END IF;
    PERFORM {s}.changed_(p_intent);
    outcome := 'applied';
END $$;

CREATE OR REPLACE FUNCTION {s}.complete(
    p_intent text, p_token bigint, p_fp bytea, p_cert bytea, p_hash text, p_clock jsonb,
    p_result_ttl float8, p_reclaim_after float8, p_cmp_domains text[], p_cmp_seqs bigint[],
    p_own_seq bigint, p_stale_reason text, p_stale_reclaim_after float8, p_keep float8,
    p_now float8,
    OUT outcome text, OUT f_state text, OUT f_token bigint, OUT f_fingerprint bytea,
    OUT f_domain text, OUT f_agent text, OUT f_lease_until float8, OUT f_cert bytea,
    OUT f_until float8, OUT f_reason text, OUT f_since float8, OUT f_seq bigint,
    OUT f_reclaim_at float8, OUT r_now float8,
    OUT s_domain text, OUT s_want bigint, OUT s_got bigint)
LANGUAGE plpgsql AS $$
DECLARE
    cur {s}.intents%ROWTYPE;
    v bigint;
BEGIN
    SELECT * INTO cur FROM {s}.intents WHERE intent = p_intent FOR UPDATE;
    IF FOUND THEN
        SELECT cur.state, cur.token, cur.fingerprint, cur.domain, cur.agent, cur.lease_until,
               cur.cert, cur.until, cur.reason, cur.since, cur.seq, cur.reclaim_at
          INTO f_state, f_token, f_fingerprint, f_domain, f_agent, f_lease_until, f_cert,
               f_until, f_reason, f_since, f_seq, f_reclaim_at;
    END IF;
    -- compare-by-token: in flight under this token, with the ticket's payload
    IF NOT FOUND OR cur.state <> 'in_flight' OR cur.token <> p_token
       OR cur.fingerprint <> p_fp THEN
        outcome := 'moved'; RETURN;
    END IF;
    IF cardinality(p_cmp_domains) > 0 OR p_own_seq IS NOT NULL THEN
        PERFORM {s}.lock_domains_(cur.domain, p_cmp_domains);
    END IF;
    IF cardinality(p_cmp_domains) > 0 THEN
        SELECT c.s_domain, c.s_want, c.s_got INTO s_domain, s_want, s_got
          FROM {s}.compare_(p_cmp_domains, p_cmp_seqs) c;
    END IF;
    IF s_domain IS NULL AND p_own_seq IS NOT NULL THEN
        v := {s}.at_(cur.domain);
        IF v <> p_own_seq THEN s_domain := cur.domain; s_want := p_own_seq; s_got := v; END IF;
    END IF;
    r_now := {s}.now_(p_now);
    IF s_domain IS NOT NULL THEN
        -- a dependency moved while the effect ran: FAILED, not DONE
        UPDATE {s}.intents SET state = 'failed', lease_until = 0, cert = NULL, until = 0,
            reason = p_stale_reason, since = r_now,
            reclaim_at = {s}.deadline_(r_now + p_stale_reclaim_after)
         WHERE intent = p_intent;
        PERFORM {s}.changed_(p_intent);
        outcome := 'stale'; RETURN;
    END IF;
    UPDATE {s}.intents SET state = 'done', lease_until = 0, cert = p_cert,
        until = {s}.deadline_(r_now + p_result_ttl), reason = '', since = 0,
        reclaim_at = {s}.deadline_(r_now + p_reclaim_after)
     WHERE intent = p_intent;
    UPDATE {s}.domains SET head = p_hash, clock = {s}.merge_(clock, p_clock)
     WHERE domain = cur.domain;
    INSERT INTO {s}.certs (domain, seq, hash, cert, committed_at, keep_until)
        VALUES (cur.domain, cur.seq, p_hash, p_cert, r_now,
                {s}.deadline_(r_now + p_result_ttl + p_keep));
    PERFORM {s}.changed_(p_intent);
    outcome := 'applied';
END $$;

-- version 2's signature, for processes that were running when the schema was upgraded:
-- their code read the record and checked the payload before this step, so the record's own
-- fingerprint is passed on (a record changed since then has another token: 'moved')
CREATE OR REPLACE FUNCTION {s}.complete(
    p_intent text, p_token bigint, p_cert bytea, p_hash text, p_clock jsonb,
    p_result_ttl float8, p_reclaim_after float8, p_cmp_domains text[], p_cmp_seqs bigint[],
    p_own_seq bigint, p_stale_reason text, p_stale_reclaim_after float8, p_keep float8,
    p_now float8,
    OUT outcome text, OUT f_state text, OUT f_token bigint, OUT f_fingerprint bytea,
    OUT f_domain text, OUT f_agent text, OUT f_lease_until float8, OUT f_cert bytea,
    OUT f_until float8, OUT f_reason text, OUT f_since float8, OUT f_seq bigint,
    OUT f_reclaim_at float8, OUT r_now float8,
    OUT s_domain text, OUT s_want bigint, OUT s_got bigint)
LANGUAGE sql AS $$
    SELECT * FROM {s}.complete(p_intent, p_token,
        (SELECT fingerprint FROM {s}.intents WHERE intent = p_intent), p_cert, p_hash, p_clock,
        p_result_ttl, p_reclaim_after, p_cmp_domains, p_cmp_seqs, p_own_seq, p_stale_reason,
        p_stale_reclaim_after, p_keep, p_now)
$$;

-- fail, release, renew: compare-by-token on the in-flight record
CREATE OR REPLACE FUNCTION {s}.finish(
    p_intent text, p_token bigint, p_op text, p_reason text, p_lease_ttl float8,
    p_reclaim_after float8, p_now float8,
    OUT outcome text, OUT f_state text, OUT f_token bigint, OUT f_fingerprint bytea,
    OUT f_domain text, OUT f_agent text, OUT f_lease_until float8, OUT f_cert bytea,
    OUT f_until float8, OUT f_reason text, OUT f_since float8, OUT f_seq bigint,
    OUT f_reclaim_at float8, OUT r_now float8)
LANGUAGE plpgsql AS $$
DECLARE cur {s}.intents%ROWTYPE;
BEGIN
    SELECT * INTO cur FROM {s}.intents WHERE intent = p_intent FOR UPDATE;
    IF FOUND THEN
        SELECT cur.state, cur.token, cur.fingerprint, cur.domain, cur.agent, cur.lease_until,
               cur.cert, cur.until, cur.reason, cur.since, cur.seq, cur.reclaim_at
          INTO f_state, f_token, f_fingerprint, f_domain, f_agent, f_lease_until, f_cert,
               f_until, f_reason, f_since, f_seq, f_reclaim_at;
    END IF;
    IF NOT FOUND OR cur.state <> 'in_flight' OR cur.token <> p_token THEN
        outcome := 'moved'; RETURN;
    END IF;
    r_now := {s}.now_(p_now);
    IF p_op = 'release' THEN
        DELETE FROM {s}.intents WHERE intent = p_intent;
    ELSIF p_op = 'fail' THEN
        UPDATE {s}.intents SET state = 'failed', lease_until = 0, reason = p_reason,
            since = r_now, reclaim_at = {s}.deadline_(r_now + p_reclaim_after)
         WHERE intent = p_intent;
    ELSE  -- renew
        UPDATE {s}.intents SET lease_until = {s}.deadline_(r_now + p_lease_ttl),
            reclaim_at = {s}.deadline_(r_now + p_reclaim_after)
         WHERE intent = p_intent;
    END IF;
    PERFORM {s}.changed_(p_intent);
    outcome := 'applied';
END $$;

CREATE OR REPLACE FUNCTION {s}.clear(p_intent text) RETURNS SETOF {s}.intents
LANGUAGE plpgsql AS $$
BEGIN
    RETURN QUERY DELETE FROM {s}.intents WHERE intent = p_intent RETURNING *;
    IF FOUND THEN PERFORM {s}.changed_(p_intent); END IF;
END $$;

-- the operator's clear: compare-and-delete of the version the decider judged
-- (base.same_record), and its audit entry, in one statement
CREATE OR REPLACE FUNCTION {s}.clear_if(
    p_intent text, p_token bigint, p_state text, p_lease_until float8, p_until float8,
    p_entry text, p_now float8,
    OUT outcome text, OUT f_state text, OUT f_token bigint, OUT f_fingerprint bytea,
    OUT f_domain text, OUT f_agent text, OUT f_lease_until float8, OUT f_cert bytea,
    OUT f_until float8, OUT f_reason text, OUT f_since float8, OUT f_seq bigint,
    OUT f_reclaim_at float8, OUT a_id bigint, OUT a_at float8)
LANGUAGE plpgsql AS $$
DECLARE cur {s}.intents%ROWTYPE; have boolean;
BEGIN
    SELECT * INTO cur FROM {s}.intents WHERE intent = p_intent FOR UPDATE;
    have := FOUND;
    IF have THEN
        SELECT cur.state, cur.token, cur.fingerprint, cur.domain, cur.agent, cur.lease_until,
               cur.cert, cur.until, cur.reason, cur.since, cur.seq, cur.reclaim_at
          INTO f_state, f_token, f_fingerprint, f_domain, f_agent, f_lease_until, f_cert,
               f_until, f_reason, f_since, f_seq, f_reclaim_at;
    END IF;
    IF NOT have OR NOT (cur.token = p_token AND cur.state = p_state
            AND cur.lease_until = p_lease_until AND cur.until = p_until) THEN
        outcome := 'moved'; RETURN;
    END IF;
    a_at := {s}.now_(p_now);
    DELETE FROM {s}.intents WHERE intent = p_intent;
    -- one clear at a time from its audit id to its commit: an id is drawn at the insert,
    -- and a reader following ids (``intents watch``) moved past one that committed later
    -- (found by review). Clears are rare
    PERFORM pg_advisory_xact_lock(hashtext({ch}), 2);
    INSERT INTO {s}.audit (intent, at, entry) VALUES (p_intent, a_at, p_entry)
        RETURNING id INTO a_id;
    PERFORM {s}.changed_(p_intent);
    outcome := 'applied';
END $$;

CREATE OR REPLACE FUNCTION {s}.evict_domain(p_domain text, OUT outcome text, OUT n bigint)
LANGUAGE plpgsql AS $$
DECLARE v_seq bigint;
BEGIN
    -- the fence row first: no claim creates a domain from the floor while it moves
    PERFORM 1 FROM {s}.fence WHERE id = 0 FOR NO KEY UPDATE;
    SELECT seq INTO v_seq FROM {s}.domains WHERE domain = p_domain FOR UPDATE;
    IF NOT FOUND THEN outcome := 'applied'; RETURN; END IF;
    SELECT count(*) INTO n FROM {s}.intents WHERE domain = p_domain AND state = 'in_flight';
    IF n > 0 THEN outcome := 'busy'; RETURN; END IF;
    DELETE FROM {s}.domains WHERE domain = p_domain;
    -- above every seq the domain handed out: no (domain, seq) pair matches again (G5)
    UPDATE {s}.fence SET floor = greatest(floor, v_seq + 1) WHERE id = 0;
    outcome := 'applied'; n := v_seq;
END $$;

-- delete up to p_limit records whose deadline passed, and certificates past retention
-- jit off: the planner's guess for the certificates' subquery crossed jit_above_cost, and
-- compiling it cost ~100 ms a sweep for a batch that runs in ~3 ms
CREATE OR REPLACE FUNCTION {s}.sweep(p_limit int, p_now float8) RETURNS int
LANGUAGE plpgsql SET jit = off AS $$
DECLARE t float8 := {s}.now_(p_now); n int;
BEGIN
    DELETE FROM {s}.intents WHERE intent IN (
        SELECT intent FROM {s}.intents WHERE reclaim_at <= t AND reclaim_at < 1e300
         ORDER BY reclaim_at LIMIT p_limit FOR UPDATE SKIP LOCKED)
      AND reclaim_at <= t;  -- re-checked on the version locked: only the one that set it
    GET DIAGNOSTICS n = ROW_COUNT;
    -- registrations of waiters gone with their records (the table holds a few rows at most)
    DELETE FROM {s}.watch w WHERE NOT EXISTS (
        SELECT 1 FROM {s}.intents i WHERE i.intent = w.intent);
    -- only a prefix of each trail: a certificate none before it still kept, with those
    -- before it (at most p_limit, in seq order); one that must wait is kept until the one
    -- it waits for (see SQLiteStore._sweep_batch); a batch is the first due ones by the
    -- certs_keep index; and where each trail now starts. One sweeper at a time: two
    -- deleting each other's locked ranges deadlocked (found by review)
    IF NOT pg_try_advisory_xact_lock(hashtext({ch}), 1) THEN
        RETURN n;
    END IF;
    WITH first AS (
        SELECT c.domain, c.seq FROM {s}.certs c
         WHERE c.keep_until <= t AND c.keep_until < 1e300
         ORDER BY c.keep_until LIMIT p_limit FOR UPDATE SKIP LOCKED),
    judged AS (
        SELECT f.domain, f.seq, (SELECT e.keep_until FROM {s}.certs e
                WHERE e.domain = f.domain AND e.seq < f.seq AND e.keep_until > t LIMIT 1)
               AS blocker
          FROM first f),
    later AS (
        UPDATE {s}.certs x SET keep_until = j.blocker FROM judged j
         WHERE j.blocker IS NOT NULL AND x.domain = j.domain AND x.seq = j.seq
        RETURNING 1),
    top AS (SELECT domain, max(seq) AS through FROM judged WHERE blocker IS NULL GROUP BY domain),
    gone AS (
        DELETE FROM {s}.certs WHERE (domain, seq) IN (
            SELECT x.domain, x.seq FROM {s}.certs x JOIN top ON x.domain = top.domain
             WHERE x.seq <= top.through AND x.keep_until <= t
             ORDER BY x.domain, x.seq LIMIT p_limit)
        RETURNING domain, seq)
    INSERT INTO {s}.trail_cuts AS x (domain, through)
        SELECT domain, max(seq) FROM gone GROUP BY domain
        ON CONFLICT (domain) DO UPDATE SET through = greatest(x.through, excluded.through);
    RETURN n;
END $$;
"""


class StoreSchemaError(RuntimeError):
    """The schema was written by a newer effectfence, is not a fence store, or (opened
    with ``create=False``) is older than this effectfence writes."""

    def __init__(self, message: str, *, schema: str, found: Any, supported: int) -> None:
        super().__init__(message)
        self.schema = schema
        self.found = found
        self.supported = supported


class _Lost(Exception):
    """The connection broke while a step ran: it may or may not have applied."""


_OURS = ("schema", "pool_max", "pool_min", "timeout", "cert_retention")


@functools.cache
def _libpq_keywords() -> frozenset[str]:
    """The connection parameters this libpq knows (PQconndefaults)."""
    return frozenset(o.keyword.decode() for o in psycopg.pq.Conninfo.get_defaults())


def _split_url(url: str) -> tuple[str, dict[str, str]]:
    """Take this store's options (``schema``, ``pool_max``, ``timeout``, ``cert_retention``)
    out of a libpq URL; everything else (sslmode, connect_timeout, ...) stays for libpq."""
    parts = urlsplit(url)
    if parts.scheme.lower() not in ("postgresql", "postgres"):
        raise ValueError(
            f"a PostgreSQL store URL looks like postgresql://user@host/db, got {mask_url(url)!r}"
        )
    ours: dict[str, str] = {}
    theirs: list[tuple[str, str]] = []
    # libpq reads "+" in a URL as a plus, never a space: so is it read here (parse_qsl
    # alone made it a space, which went on to libpq as %20: a password with a "+" failed
    # as "can't connect, retry later", found by review)
    for k, v in query_pairs(parts.query, url, plus_is_plus=True):
        if k in _OURS:
            ours[k] = v
        elif k in _libpq_keywords():
            theirs.append((k, v))
        else:
            # libpq refuses it too, but only once the pool has waited out its timeout, and
            # then as "can't connect, retry later" (found by review)
            raise ValueError(
                f"unknown option {k!r} in {mask_url(url)}: this store's are "
                f"{', '.join(_OURS)}; the rest go to libpq, which knows no {k!r}"
            )
    # %20 for a space, not urlencode's default "+", which libpq reads as a plus: the usual
    # options=-c%20statement_timeout%3D5000 reached the server as "-c+statement_timeout"
    # and failed as "unavailable, retry later" (found by review)
    try:
        query = urlencode(theirs, quote_via=quote)
        # by hand: urlunsplit drops the "//" of an empty host, and libpq refused the usual
        # Unix-socket URL postgresql:///db as postgresql:/db (found by review)
        conninfo = f"{parts.scheme}://{parts.netloc}{parts.path}" + (f"?{query}" if query else "")
        if parts.fragment:
            conninfo += f"#{parts.fragment}"
        conninfo_to_dict(conninfo)  # libpq's own parser, now: not the pool's, after its timeout
    except (psycopg.Error, UnicodeError) as exc:
        # a %00 or a bad %-escape failed only inside the pool, after the whole timeout, as
        # "can't connect, retry later" (found by review). libpq quotes the token it cannot
        # read, which may be a password (in the URL's user part or its query): never shown
        why = re.sub(r'"[^"]*"', '"..."', str(exc)) if isinstance(exc, psycopg.Error) else ""
        raise ValueError(f"libpq can't read {mask_url(url)}: {why or 'not valid text'}") from None
    return conninfo, ours


def _deadline(t: Any) -> float:
    return math.inf if t >= NEVER else float(t)


_SYNC_NOTE = (
    "synchronous_commit was off for this role/database: effectfence sets it on for its own "
    "steps (a commit it reports survives a server crash)"
)
#: a session set up for steps, in one statement that answers what it found:
#: ``synchronous_commit`` on where it is off (a commit reported survives a server crash),
#: and READ COMMITTED, which the step functions rely on: each statement sees what committed
#: before its locks were granted. Under a REPEATABLE READ default (database or role) a
#: compare read the snapshot taken before its locks, and two claims on each other's new
#: domains both ran (found by review)
_PIN = (
    "WITH was AS MATERIALIZED (SELECT current_setting('synchronous_commit') AS sc, "
    "current_setting('default_transaction_isolation') AS iso) "
    "SELECT sc, iso, set_config('synchronous_commit', CASE sc WHEN 'off' THEN 'on' ELSE sc END, "
    "false), set_config('default_transaction_isolation', 'read committed', false) FROM was"
)
_RESTORE = (
    "SELECT set_config('synchronous_commit', %s, false), "
    "set_config('default_transaction_isolation', %s, false)"
)


class PostgresStore(FenceStore):
    """Durable store in one PostgreSQL schema, shared by every process that reaches it.

    ``conninfo``: a libpq URL or DSN; or ``pool``: a :class:`psycopg_pool.ConnectionPool`
    of your own (its connections are used in autocommit; the store does not close it).
    ``schema``: where the tables live (created on first use). ``cert_retention``: seconds a
    certificate stays in the audit trail after its result expires (None: forever).
    ``clock``: for tests only, replaces the server's ``clock_timestamp()`` in every step.
    ``create=False``: open only a schema a store wrote (:class:`StoreMissing` otherwise), of
    this code's version (an older one is refused, not upgraded), for looking without writing.
    """

    name = "postgresql"
    counters_backend = "sql"
    shared = True
    #: a claim that finds a record reads it without a lock and writes nothing (schema
    #: version 6), so prepare claims first: a fresh attempt is two round trips, not three
    put_first = True

    def __init__(
        self,
        conninfo: str | None = None,
        *,
        pool: psycopg_pool.ConnectionPool[Any] | None = None,
        schema: str = DEFAULT_SCHEMA,
        pool_min: int = 1,
        pool_max: int = DEFAULT_POOL_MAX,
        timeout: float = DEFAULT_TIMEOUT,
        cert_retention: float | None = None,
        clock: Callable[[], float] | None = None,
        create: bool = True,
    ) -> None:
        if (conninfo is None) == (pool is None):
            raise ValueError("give a PostgreSQL store either conninfo or pool, not both")
        if not _SCHEMA_NAME.match(schema):
            raise ValueError(f"schema must match {_SCHEMA_NAME.pattern}, got {schema!r}")
        if cert_retention is not None and not cert_retention >= 0:
            raise ValueError("cert_retention must be >= 0 seconds, or None to keep forever")
        timeout = step_timeout(timeout)
        self.schema = schema
        self._create = create
        self.timeout = float(timeout)
        self.cert_retention = math.inf if cert_retention is None else float(cert_retention)
        self._clock = clock
        self._channel = f"effectfence_{schema}"
        self._closed = False
        self._notes: list[str] = []  # what the connect-time checks found and changed
        self._checked: weakref.WeakSet[psycopg.Connection[Any]] = weakref.WeakSet()
        self._checked_lock = _fork.lock()
        self._certs = CertCache(_CERT_CACHE)
        self._key: bytes | None = None
        self._own_pool = pool is None
        self._pool_size = (pool_min, max(pool_min, pool_max))
        self._fork = _fork.generation()
        if pool is None:
            assert conninfo is not None
            self._conninfo = conninfo
            self._link = _link_options(conninfo, self.timeout)
            pool = self._open_pool()
        else:
            info = pool.conninfo
            self._conninfo = info if isinstance(info, str) else info()
            self._link = _link_options(self._conninfo, self.timeout)  # for the listener
        self._pool: psycopg_pool.ConnectionPool[Any] = pool
        self._s = sql.Identifier(schema)
        self._prepare_sql()
        self._waiters = Waiters()
        self._listener: threading.Thread | None = None
        self._listen_conn: psycopg.Connection[Any] | None = None
        self._listener_lock = _fork.lock()
        self._relisten_at = 0.0
        try:
            self.store_id = self._init_schema()
        except BaseException:
            self.close()
            raise
        self.ticket_scope = f"postgresql:{self.store_id}"

    @classmethod
    def from_url(cls, url: str, **options: Any) -> PostgresStore:
        """``postgresql://user@host/db?schema=fence&pool_max=8&timeout=10&cert_retention=…``;
        keywords win over the query; other query parameters go to libpq."""
        conninfo, query = _split_url(url)
        opts: dict[str, Any] = {}
        for key, value in query.items():
            try:
                if key == "schema":
                    opts[key] = value
                elif key in ("pool_min", "pool_max"):
                    opts[key] = int(value)
                else:
                    opts[key] = float(value)
            except ValueError:
                raise ValueError(f"{key} in {mask_url(url)} must be a number") from None
        opts.update(options)
        if "pool" in opts:
            return cls(**opts)
        return cls(conninfo, **opts)

    def __repr__(self) -> str:
        return f"PostgresStore(url={mask_url(self._conninfo)!r}, schema={self.schema!r})"

    # -- connections --------------------------------------------------------------------------
    def _open_pool(self) -> psycopg_pool.ConnectionPool[Any]:
        pool_min, pool_max = self._pool_size
        pool: psycopg_pool.ConnectionPool[Any] | None = None
        failed: list[str] = []  # what the pool's own connection attempts were told
        try:
            pool = psycopg_pool.ConnectionPool(
                self._conninfo,
                connection_class=_recording(failed),
                min_size=pool_min,
                max_size=pool_max,
                kwargs={"autocommit": True, **self._link},
                configure=self._configure,
                timeout=self.timeout,
                name=f"effectfence-{self.schema}",
                open=False,
            )
            pool.open(wait=True, timeout=self.timeout)
        except (psycopg.Error, psycopg_pool.PoolTimeout) as exc:
            if pool is not None:
                with contextlib.suppress(Exception):
                    # a worker may sit in a connect to a server that never answers: it ends
                    # on its own connect_timeout, the open does not wait for it
                    pool.close(timeout=_CLOSE_UNOPENED)
            # The pool says only "initialization incomplete": a wrong role or a missing
            # database was reported without its cause (found by review), and asking again
            # on a connection of our own made an open against a hung server take its
            # timeout twice over and more. Its last attempt's words are kept instead.
            last, said = _last_words(failed[-1] if failed else "", exc)
            raise StoreUnavailable(
                f"can't connect to PostgreSQL at {mask_url(self._conninfo)}: {exc}"
                + (f"; the server says: {said}" if said else "")
                + (f"; the last attempt: {last}" if last and not said else ""),
                operation="open",
                server_reply=said or None,
            ) from exc
        return pool

    def _forked(self, op: str) -> None:
        """First use in a forked child. A pooled connection's socket is shared with the
        parent: both processes' messages would interleave on one session, and either could
        read the other's answer. A pool the store opened is replaced by one of the child's
        own; the caller's pool cannot be, so the step is refused."""
        with _fork.LOCK:
            if self._fork == _fork.generation():  # another thread of the child came first
                return
            if not self._own_pool:
                raise StoreUnavailable(
                    f"the PostgreSQL store {self.schema!r} runs on a pool opened before this "
                    "process was forked; open the pool (or the store) in the child",
                    operation=op,
                )
            _fork.abandon(self._pool, self._listen_conn)  # the parent's: never touched
            self._listen_conn, self._listener = None, None
            self._checked = weakref.WeakSet()
            self._waiters = Waiters()
            self._pool = self._open_pool()
            self._fork = _fork.generation()

    def _pin(self, conn: psycopg.Connection[Any]) -> tuple[str, str]:
        """Set ``conn`` up for steps (:data:`_PIN`); returns the synchronous_commit and
        default_transaction_isolation it had."""
        row = conn.execute(_PIN).fetchone()
        assert row is not None
        if row[0] == "off" and _SYNC_NOTE not in self._notes:
            self._notes.append(_SYNC_NOTE)
        return str(row[0]), str(row[1])

    def _configure(self, conn: psycopg.Connection[Any]) -> None:
        """On every new connection of the store's own pool (no one else uses its sessions):
        never commit without waiting for the WAL flush, and READ COMMITTED."""
        self._pin(conn)
        if not conn.autocommit:
            conn.commit()
        with self._checked_lock:
            self._checked.add(conn)

    @contextlib.contextmanager
    def _conn(self, op: str) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection in autocommit; unavailable if none comes within ``timeout``."""
        if self._closed:
            raise StoreUnavailable(f"the PostgreSQL store {self.schema!r} is closed", operation=op)
        if self._fork != _fork.generation():
            self._forked(op)
        try:
            cm = self._pool.connection(timeout=self.timeout)
            conn = cm.__enter__()
        except (psycopg.Error, psycopg_pool.PoolTimeout, psycopg_pool.PoolClosed) as exc:
            raise self._unavailable(op, exc) from exc
        try:
            lent = None if self._own_pool else self._borrow(op, conn)
            try:
                yield conn
            finally:
                if lent is not None:
                    self._give_back(conn, lent)
        except BaseException as exc:
            cm.__exit__(type(exc), exc, exc.__traceback__)
            raise
        else:
            cm.__exit__(None, None, None)

    def _borrow(
        self, op: str, conn: psycopg.Connection[Any]
    ) -> tuple[bool, tuple[str, str] | None]:
        """A connection of the caller's pool, set up for one step: autocommit, and the
        settings of :data:`_PIN`, on every borrow (one round trip): the application may
        change its session's between two (found by review: switched to asynchronous
        commit after the first borrow, the store's commits were acknowledged unflushed).
        Returns what to put back (:meth:`_give_back`): the caller's connections are lent,
        not taken over (found by review: left in autocommit, the application's own ``with
        pool.connection()`` blocks stopped being transactions, and one that raised halfway
        stayed half applied)."""
        try:
            first = conn not in self._checked
            if first and _hung_up(conn):
                raise psycopg.OperationalError("the server closed this idle connection")
            was = conn.autocommit
            if not was:
                conn.autocommit = True
            sc, iso = self._pin(conn)
            if first:
                with self._checked_lock:
                    self._checked.add(conn)
        except psycopg.Error as exc:
            # nothing of a step was sent: typed, and the pool drops the connection
            # (a raw driver error escaped here, found by review)
            conn.close()
            raise self._unavailable(op, exc) from exc
        except BaseException:
            # an interrupt between the switch and the return: the connection cannot be put
            # back as it was lent, so the pool drops it (found by review)
            conn.close()
            raise
        return was, (None if sc != "off" and iso == "read committed" else (sc, iso))

    @staticmethod
    def _give_back(
        conn: psycopg.Connection[Any], lent: tuple[bool, tuple[str, str] | None]
    ) -> None:
        """The caller's connection as it was lent; one that cannot be put back so is
        closed, and its pool drops it."""
        was, settings = lent
        if conn.closed or conn.broken:
            return
        try:
            if settings is not None:
                conn.execute(_RESTORE, settings)
            if not was:
                conn.autocommit = False
        except psycopg.Error:
            conn.close()

    def _unavailable(self, op: str, exc: BaseException) -> StoreUnavailable:
        return StoreUnavailable(
            f"the PostgreSQL store {self.schema!r} failed during {op}: {exc}; nothing was decided",
            operation=op,
        )

    def _run(self, op: str, query: Any, params: Sequence[Any]) -> list[Any]:
        """One statement: its rows. Raises StoreUnavailable when it certainly did not apply
        (no connection, an error the server answered), :class:`_Lost` when the connection
        broke while it ran. A deadlock or serialization abort applied nothing: run again."""
        for attempt in range(_MAX_RETRIES):
            with self._conn(op) as conn:
                if _hung_up(conn) and attempt + 1 < _MAX_RETRIES:
                    conn.close()  # the pool drops it; nothing was sent on it
                    continue
                try:
                    return self._execute(conn, query, params)
                except psycopg.Error as exc:
                    if conn.broken or conn.closed:
                        raise _Lost(str(exc)) from exc
                    if exc.sqlstate in _RETRY_SQLSTATES and attempt + 1 < _MAX_RETRIES:
                        continue
                    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
                        raise self._unavailable(op, exc) from exc
                    state = exc.sqlstate or ""
                    if state in _REFUSED_SQLSTATES or state.startswith(_REFUSED_CLASSES):
                        raise self._unavailable(op, exc) from exc
                    raise
        raise AssertionError("unreachable")

    @staticmethod
    def _execute(conn: psycopg.Connection[Any], query: Any, params: Sequence[Any]) -> list[Any]:
        """The one place a statement reaches the server (tests wrap it to inject faults)."""
        cur = conn.execute(query, params, binary=True)
        # the result's status, not ``cur.description``: that builds a Column per column
        res = cur.pgresult
        return cur.fetchall() if res is not None and res.status == _TUPLES_OK else []

    def _read(self, op: str, query: Any, params: Sequence[Any]) -> list[Any]:
        """A read: it changes nothing, so a broken connection is retried once on another."""
        try:
            return self._run(op, query, params)
        except _Lost:
            try:
                return self._run(op, query, params)
            except _Lost as exc:
                raise self._unavailable(op, exc) from exc

    # -- schema -------------------------------------------------------------------------------
    def _prepare_sql(self) -> None:
        s = self._s
        q = sql.SQL
        self._q_get = q("SELECT " + _F + " FROM {}.intents WHERE intent = %s").format(s)
        self._q_watch = q("SELECT " + _F + " FROM {}.watch_(%s, %s)").format(s)
        self._q_read = q(
            "SELECT {}.now_(%s::float8), " + ", ".join(f"i.{c}" for c in RECORD_FIELDS) + " "
            "FROM (SELECT 1) AS one LEFT JOIN {}.intents i ON i.intent = %s"
        ).format(s, s)
        self._q_now = q("SELECT {}.now_(%s::float8)").format(s)
        self._q_at = q("SELECT {}.at_(%s)").format(s)
        self._q_in_flight = q(
            "SELECT count(*) FROM {}.intents WHERE domain = %s AND state = 'in_flight'"
        ).format(s)
        # prepare's claim as if the slot were empty (put_first), with nothing compared and
        # no seq asked for: the common case. A record found is answered by the plain
        # primary-key SELECT in front, at about a read's cost (a PL/pgSQL call costs ~25 us
        # more); LIMIT 1 stops the Append there, so only an empty slot calls the claim.
        # (Were the claim ever called anyway, it would find the record and write nothing,
        # and its row would come second: the answer is the same.)
        self._q_claim_first = q(
            "(SELECT 'moved', " + ", ".join(f"i.{c}" for c in RECORD_FIELDS[1:]) + ", "
            "NULL::bigint, NULL::bigint, {}.now_(%s::float8), NULL::text, NULL::jsonb, "
            "NULL::text, NULL::bigint, NULL::bigint FROM {}.intents i WHERE i.intent = %s) "
            "UNION ALL (SELECT c.* FROM {}.claim(%s, false, NULL, NULL, NULL, NULL, %s, %s, "
            "%s, %s, %s, '{{}}'::text[], '{{}}'::bigint[], NULL, %s::float8) c) LIMIT 1"
        ).format(s, s, s)
        self._q_claim = q(
            "SELECT * FROM {}.claim(%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, "
            "%s::text[], %s::bigint[], %s::bigint, %s::float8)"
        ).format(s)
        self._q_complete = q(
            "SELECT * FROM {}.complete(%s, %s, %s, %s, %s, %s::jsonb, %s, %s, %s::text[], "
            "%s::bigint[], %s::bigint, %s, %s, %s, %s::float8)"
        ).format(s)
        self._q_finish = q(
            "SELECT * FROM {}.finish(%s, %s, %s, %s, %s::float8, %s::float8, %s::float8)"
        ).format(s)
        self._q_clear = q("SELECT " + _F + " FROM {}.clear(%s)").format(s)
        self._q_clear_if = q(
            "SELECT * FROM {}.clear_if(%s, %s, %s, %s::float8, %s::float8, %s, %s::float8)"
        ).format(s)
        self._q_evict = q("SELECT * FROM {}.evict_domain(%s)").format(s)
        self._q_sweep = q("SELECT {}.sweep(%s, %s::float8)").format(s)
        self._q_certs = q(
            "SELECT cert FROM {}.certs WHERE domain = %s AND seq > %s ORDER BY seq LIMIT %s"
        ).format(s)
        # Rendered once: a Composed query is re-rendered on every execute, and psycopg
        # caches its parse of a query by the query's bytes. (The schema name is checked
        # against _SCHEMA_NAME, so quoting it needs no connection.)
        for name, value in list(vars(self).items()):
            if name.startswith("_q_") and isinstance(value, sql.Composable):
                setattr(self, name, value.as_bytes(None))

    def _init_schema(self) -> str:
        """Create the schema on first use (once, under an advisory lock), refuse a newer one."""
        s = self._s
        key = int.from_bytes(hashlib.sha256(b"effectfence:" + self.schema.encode()).digest()[:8])
        key -= 1 << 63  # a signed bigint
        with self._conn("open") as conn:
            try:
                with conn.transaction():
                    conn.execute("SELECT pg_advisory_xact_lock(%s)", (key,))
                    exists = conn.execute(
                        "SELECT to_regclass(%s) IS NOT NULL, "
                        "EXISTS (SELECT 1 FROM pg_namespace WHERE nspname = %s)",
                        (f"{self.schema}.meta", self.schema),
                    ).fetchone()
                    assert exists is not None
                    found: Any = None
                    if exists[0]:
                        row = conn.execute(
                            sql.SQL(
                                "SELECT value FROM {}.meta WHERE key = 'schema_version'"
                            ).format(s)
                        ).fetchone()
                        found = None if row is None else row[0]
                        if found is None or not str(found).isdigit() or int(found) > SCHEMA_VERSION:
                            raise StoreSchemaError(
                                f"schema {self.schema!r} has effectfence schema version "
                                f"{found!r}; this effectfence reads version {SCHEMA_VERSION}: "
                                "upgrade effectfence (or use another ?schema=)",
                                schema=self.schema,
                                found=found,
                                supported=SCHEMA_VERSION,
                            )
                        if int(found) < SCHEMA_VERSION and not self._create:
                            # looking upgraded it (found by review): then every process of
                            # the older effectfence still using it refused to start again
                            raise StoreSchemaError(
                                f"schema {self.schema!r} has effectfence schema version "
                                f"{found}; this effectfence would upgrade it to "
                                f"{SCHEMA_VERSION}, and an effectfence that reads only "
                                f"version {found} would then refuse to open it. Looking "
                                "changes nothing: use the effectfence its processes run, or "
                                "upgrade it on purpose (open it with create=True: "
                                "effectfence info --store URL --create)",
                                schema=self.schema,
                                found=found,
                                supported=SCHEMA_VERSION,
                            )
                    elif not self._create:
                        raise StoreMissing(
                            f"no store in PostgreSQL schema {self.schema!r}: nothing has used "
                            "it yet, or the URL names another schema or database"
                        )
                    elif exists[1]:
                        tables = conn.execute(
                            "SELECT count(*) FROM pg_tables WHERE schemaname = %s", (self.schema,)
                        ).fetchone()
                        if tables and tables[0]:
                            raise StoreSchemaError(
                                f"schema {self.schema!r} exists but is not an effectfence "
                                "store (it has tables but no meta)",
                                schema=self.schema,
                                found=None,
                                supported=SCHEMA_VERSION,
                            )
                    if found is None or int(found) < SCHEMA_VERSION:
                        ddl = _DDL.format(
                            s=f'"{self.schema}"',
                            sname="'" + self.schema.replace("'", "''") + ":'",
                            f=_F,
                            ch=f"'{self._channel}'",
                            max_head=MAX_HEAD_AGENTS,
                            kept_head=HEAD_AGENTS_KEPT,
                        )
                        conn.execute(ddl.encode())
                        conn.execute(
                            sql.SQL(
                                "INSERT INTO {}.meta (key, value) VALUES ('schema_version', %s), "
                                "('store_id', %s) ON CONFLICT (key) DO UPDATE SET value = "
                                "CASE WHEN {}.meta.key = 'schema_version' THEN excluded.value "
                                "ELSE {}.meta.value END"
                            ).format(s, s, s),
                            (str(SCHEMA_VERSION), secrets.token_hex(16)),
                        )
                    row = conn.execute(
                        sql.SQL("SELECT value FROM {}.meta WHERE key = 'store_id'").format(s)
                    ).fetchone()
                    assert row is not None
                    return str(row[0])
            except psycopg.OperationalError as exc:
                raise self._unavailable("open", exc) from exc

    def describe(self) -> dict[str, Any]:
        """Name, place and durability, for ``effectfence info --store`` and stats."""
        settings: dict[str, Any] = {}
        with contextlib.suppress(StoreUnavailable, _Lost):
            rows = self._run(
                "describe",
                "SELECT current_setting('synchronous_commit'), current_setting('fsync'), "
                "current_setting('server_version'), current_database()",
                (),
            )
            sc, fsync, version, db = rows[0]
            settings = {
                "synchronous_commit": sc,
                "fsync": fsync,
                "server_version": version,
                "database": db,
            }
        return {
            "store": self.name,
            "url": mask_url(self._conninfo),
            "schema": self.schema,
            "schema_version": SCHEMA_VERSION,
            "ticket_scope": self.ticket_scope,
            "cert_retention": None if self.cert_retention == math.inf else self.cert_retention,
            **settings,
            "notes": list(self._notes),
        }

    # -- records ------------------------------------------------------------------------------
    def _cert(self, data: bytes | None) -> Any:
        return None if data is None else self._certs.decode(data)

    def _decode(self, intent: str, row: Sequence[Any]) -> IntentRecord:
        """A record from the columns after ``intent`` (``state`` .. ``reclaim_at``)."""
        (state, token, fp, domain, agent, lease_until, cert, until, reason, since, seq,
         reclaim_at) = row  # fmt: skip
        return IntentRecord(
            intent,
            _STATES[state],
            token,
            fp,
            domain,
            agent,
            _deadline(lease_until),
            self._cert(cert),
            _deadline(until),
            reason,
            since,
            seq,
            _deadline(reclaim_at),
        )

    def _found(self, intent: str, row: Sequence[Any], at: int) -> IntentRecord | None:
        """The found record of a step's answer: its 12 columns from ``at`` (state NULL: none)."""
        return None if row[at] is None else self._decode(intent, row[at : at + 12])

    # -- reads --------------------------------------------------------------------------------
    def _p_now(self) -> float | None:
        return None if self._clock is None else float(self._clock())

    def now(self) -> float:
        return float(self._read("now", self._q_now, (self._p_now(),))[0][0])

    def get(self, intent: str) -> IntentRecord | None:
        rows = self._read("get", self._q_get, (intent,))
        return self._decode(intent, rows[0][1:]) if rows else None

    def read(self, intent: str) -> tuple[IntentRecord | None, float]:
        """The record and the server's clock in one statement: a replay is one round trip."""
        (row,) = self._read("read", self._q_read, (self._p_now(), intent))
        return (None if row[1] is None else self._decode(intent, row[2:])), float(row[0])

    def current(self, domain: str) -> int:
        return int(self._read("current", self._q_at, (domain,))[0][0])

    def in_flight(self, domain: str) -> int:
        return int(self._read("in_flight", self._q_in_flight, (domain,))[0][0])

    def size(self) -> dict[str, int]:
        s = self._s
        (row,) = self._read(
            "size",
            sql.SQL(
                "SELECT (SELECT count(*) FROM {}.intents), (SELECT count(*) FROM {}.domains), "
                "(SELECT count(*) FROM {}.domains WHERE head IS NOT NULL), "
                "(SELECT count(*) FROM {}.certs)"
            ).format(s, s, s, s),
            (),
        )
        return {"records": row[0], "domains": row[1], "heads": row[2], "certs": row[3]}

    def records(
        self, *, states: Sequence[State] = (), domain: str | None = None, limit: int = 1000
    ) -> Iterator[IntentRecord]:
        where: list[sql.Composable] = []
        params: list[Any] = []
        if states:
            where.append(sql.SQL("state = ANY(%s::text[])"))
            params.append([st.value for st in states])
        if domain is not None:
            where.append(sql.SQL("domain = %s"))
            params.append(domain)
        query = sql.SQL("SELECT " + _F + " FROM {}.intents").format(self._s)
        if where:
            query = query + sql.SQL(" WHERE ") + sql.SQL(" AND ").join(where)
        query = query + sql.SQL(" ORDER BY intent LIMIT %s")
        for row in self._read("records", query, (*params, max(0, int(limit)))):
            yield self._decode(row[0], row[1:])

    def certs(self, domain: str, *, after_seq: int = 0, limit: int = 1000) -> Iterator[Any]:
        """Committed certificates of ``domain`` after ``after_seq``, in seq order."""
        rows = self._read("certs", self._q_certs, (domain, after_seq, max(0, int(limit))))
        for (cert,) in rows:
            yield cert_from_json(cert)

    def trail_cut(self, domain: str) -> int:
        rows = self._read(
            "trail_cut",
            sql.SQL("SELECT through FROM {}.trail_cuts WHERE domain = %s").format(self._s),
            (domain,),
        )
        return int(rows[0][0]) if rows else 0

    def sealing_key(self) -> bytes:
        """Kept in the ``meta`` table (get-or-create): every process sharing the schema seals
        and opens tickets with the same key."""
        if self._key is None:
            s = self._s
            with contextlib.suppress(_Lost):  # it may have applied: the read below says
                self._run(
                    "sealing_key",
                    sql.SQL(
                        "INSERT INTO {}.meta (key, value) VALUES ('sealing_key', %s) "
                        "ON CONFLICT (key) DO NOTHING"
                    ).format(s),
                    (secrets.token_hex(32),),
                )
            rows = self._read(
                "sealing_key",
                sql.SQL("SELECT value FROM {}.meta WHERE key = 'sealing_key'").format(s),
                (),
            )
            if not rows:  # its insert was cut before it applied
                raise StoreUnavailable(
                    f"the PostgreSQL store {self.schema!r} could not store its sealing key "
                    "(the connection was cut); nothing was decided",
                    operation="sealing_key",
                )
            self._key = bytes.fromhex(rows[0][0])
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
        query: Any
        params: tuple[Any, ...]
        if expect is None and not compare and reserve_at is None:
            query = self._q_claim_first  # the common case: a record found costs a read
            p_now = self._p_now()
            params = (
                p_now,
                intent,
                intent,
                bytes(fingerprint),
                domain,
                agent,
                lease_ttl,
                reclaim_after,
                p_now,
            )
        else:
            query = self._q_claim
            params = (
                intent,
                expect is not None,
                None if expect is None else expect.token,
                None if expect is None else expect.state.value,
                None if expect is None else min(expect.lease_until, NEVER),
                None if expect is None else min(expect.until, NEVER),
                bytes(fingerprint),
                domain,
                agent,
                lease_ttl,
                reclaim_after,
                [d for d, _ in compare],
                [s for _, s in compare],
                reserve_at,
                self._p_now(),
            )
        try:
            try:
                (row,) = self._run("claim", query, params)
            except psycopg.Error as exc:
                if exc.sqlstate != "EF001":
                    raise
                # condition 1 judged an empty slot that another claim filled: MOVED
                return Step(MOVED, found=self.get(intent))
        except _Lost as exc:
            # the claim may have applied and lost its reply; its lease lapses like a crashed
            # holder's, and this caller runs nothing
            if expect is None:
                finished = self.finished_after_lost_claim(intent)
                if finished is not None:
                    return finished
            raise self._unavailable("claim", exc) from exc
        outcome, now = row[0], row[15]  # every outcome carries the server's clock
        found = self._found(intent, row, 1)
        if outcome == "moved":
            return Step(MOVED, found=found, now=now)
        if outcome == "stale":
            return Step(STALE, found=found, stale=(row[18], row[19], row[20]), now=now)
        if outcome == "race":
            return Step(RACE, found=found, stale=(row[18], row[19], row[20]), now=now)
        token, seq = row[13], row[14]
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
        head = EMPTY_HEAD if row[16] is None else Head(row[16], row[17] or {})
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
        params = (
            intent,
            token,
            bytes(fingerprint),
            cert_json,
            cert.hash,
            json.dumps(cert.vector_clock, separators=(",", ":")),
            result_ttl,
            reclaim_after,
            [d for d, _ in compare],
            [s for _, s in compare],
            own_seq,
            stale_reason,
            stale_reclaim_after,
            self.cert_retention,
            self._p_now(),
        )

        def applied(rec: IntentRecord) -> bool:
            return rec.state is State.DONE and getattr(rec.cert, "hash", None) == cert.hash

        try:
            (row,) = self._run("complete", self._q_complete, params)
        except _Lost as exc:
            q = self._q_complete
            return self._reconcile("complete", intent, token, applied, exc, q, params)
        return self._complete_step(
            intent, row, cert, result_ttl, reclaim_after, stale_reason, stale_reclaim_after
        )

    def _complete_step(
        self,
        intent: str,
        row: Sequence[Any],
        cert: Any,
        result_ttl: float,
        reclaim_after: float,
        stale_reason: str,
        stale_reclaim_after: float,
    ) -> Step:
        outcome = row[0]
        cur = self._found(intent, row, 1)
        if outcome == "moved":
            return Step(MOVED, found=cur)
        assert cur is not None
        now = row[13]
        if outcome == "stale":
            rec = IntentRecord(
                intent,
                State.FAILED,
                cur.token,
                cur.fingerprint,
                cur.domain,
                cur.agent,
                reason=stale_reason,
                since=now,
                seq=cur.seq,
                reclaim_at=_deadline(min(now + stale_reclaim_after, NEVER)),
            )
            return Step(STALE, rec, cur, stale=(row[14], row[15], row[16]))
        rec = IntentRecord(
            intent,
            State.DONE,
            cur.token,
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

    def _reconcile(
        self,
        op: str,
        intent: str,
        token: int,
        applied: Callable[[IntentRecord], bool],
        exc: _Lost,
        query: Any,
        params: Sequence[Any],
    ) -> Step:
        """The connection broke while a ticket step ran: answer from what the store holds.

        - the record shows this step's result under this token: APPLIED (only the reply
          was lost);
        - still in flight under this token: the step did not apply (or is still running on
          a server that has not noticed yet): run it once more; its own compare-by-token
          makes that safe, and a second loss is reported unavailable;
        - anything else: MOVED with what is there. Never an answer the store does not hold.
        """
        try:
            rec = self.get(intent)
        except StoreUnavailable as again:
            raise self._unavailable(op, again) from exc
        if rec is not None and rec.token == token:
            if applied(rec):
                return Step(APPLIED, rec, None)
            if rec.state is State.IN_FLIGHT:
                try:
                    (row,) = self._run(op, query, params)
                except _Lost as lost:
                    raise self._unavailable(op, lost) from exc
                step = self._finish_step(op, intent, row, params)
                return settled(step, lambda r: r is not None and applied(r))
        return Step(MOVED, found=rec)

    def _finish_step(self, op: str, intent: str, row: Sequence[Any], params: Sequence[Any]) -> Step:
        if op == "complete":
            return self._complete_step(
                intent, row, _cert_of(params), params[6], params[7], params[11], params[12]
            )
        outcome = row[0]
        cur = self._found(intent, row, 1)
        if outcome == "moved":
            return Step(MOVED, found=cur)
        assert cur is not None
        now = row[13]
        kind = params[2]
        if kind == "release":
            return Step(APPLIED, None, cur)
        if kind == "fail":
            rec = IntentRecord(
                intent,
                State.FAILED,
                cur.token,
                cur.fingerprint,
                cur.domain,
                cur.agent,
                reason=params[3],
                since=now,
                seq=cur.seq,
                reclaim_at=_deadline(min(now + params[5], NEVER)),
            )
            return Step(APPLIED, rec, cur)
        rec = IntentRecord(
            intent,
            State.IN_FLIGHT,
            cur.token,
            cur.fingerprint,
            cur.domain,
            cur.agent,
            lease_until=_deadline(min(now + params[4], NEVER)),
            seq=cur.seq,
            reclaim_at=_deadline(min(now + params[5], NEVER)),
        )
        return Step(APPLIED, rec, cur)

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
        params = (intent, token, kind, reason, lease_ttl, reclaim_after, self._p_now())
        try:
            (row,) = self._run(kind, self._q_finish, params)
        except _Lost as exc:
            try:
                rec = self.get(intent)
            except StoreUnavailable as again:
                raise self._unavailable(kind, again) from exc
            if applied(rec):
                return Step(APPLIED, rec, None)
            if rec is not None and rec.token == token and rec.state is State.IN_FLIGHT:
                try:
                    (row,) = self._run(kind, self._q_finish, params)
                except _Lost as lost:
                    raise self._unavailable(kind, lost) from exc
                step = self._finish_step("finish", intent, row, params)
                return settled(step, applied)
            if rec is not None and applied(None):  # a release: see release_untold
                raise release_untold(
                    f"the PostgreSQL store {self.schema!r}", intent, rec.token
                ) from exc
            return Step(MOVED, found=rec)
        return self._finish_step("finish", intent, row, params)

    def fail(self, intent: str, token: int, reason: str, *, reclaim_after: float) -> Step:
        return self._finish(
            "fail",
            intent,
            token,
            reason,
            0.0,
            reclaim_after,
            lambda r: (
                r is not None
                and r.token == token
                and r.state is State.FAILED
                and r.reason == reason
            ),
        )

    def release(self, intent: str, token: int) -> Step:
        # a lost reply and no record: released (or cleared since): the intent is free
        return self._finish("release", intent, token, "", 0.0, 0.0, lambda r: r is None)

    def renew(self, intent: str, token: int, *, lease_ttl: float, reclaim_after: float) -> Step:
        # a lost reply: renewing again is harmless, so "in flight under this token" retries
        return self._finish("renew", intent, token, "", lease_ttl, reclaim_after, lambda r: False)

    def clear(self, intent: str) -> IntentRecord | None:
        try:
            rows = self._run("clear", self._q_clear, (intent,))
        except _Lost as exc:
            raise self._unavailable("clear", exc) from exc
        return self._decode(intent, rows[0][1:]) if rows else None

    def clear_if(self, intent: str, *, expect: IntentRecord, entry: Mapping[str, Any]) -> Step:
        data = entry_to_json(entry)
        params = (
            intent,
            expect.token,
            expect.state.value,
            min(expect.lease_until, NEVER),
            min(expect.until, NEVER),
            data,
            self._p_now(),
        )
        try:
            (row,) = self._run("clear", self._q_clear_if, params)
        except _Lost as exc:
            # the clear may have applied: the operator looks again (show, audit) rather
            # than being told something this store does not know
            raise self._unavailable("clear", exc) from exc
        found = self._found(intent, row, 1)
        if row[0] == "moved":
            return Step(MOVED, found=found)
        return Step(APPLIED, None, found, entry=entry_from_json(data, row[13], row[14]))

    def audit(
        self, *, intent: str | None = None, after: int | None = None, limit: int = 100
    ) -> list[dict[str, Any]]:
        where = [sql.SQL("id > %s")]
        params: list[Any] = [-1 if after is None else int(after)]
        if intent is not None:
            where.append(sql.SQL("intent = %s"))
            params.append(intent)
        order = sql.SQL("ASC" if after is not None else "DESC")
        query = sql.SQL("SELECT id, at, entry FROM {}.audit WHERE {} ORDER BY id {} LIMIT %s")
        rows = self._read(
            "audit",
            query.format(self._s, sql.SQL(" AND ").join(where), order),
            (*params, max(0, int(limit))),
        )
        if after is None:
            rows.reverse()
        return [entry_from_json(data, i, at) for i, at, data in rows]

    def evict_domain(self, domain: str) -> Step:
        try:
            ((outcome, n),) = self._run("evict_domain", self._q_evict, (domain,))
        except _Lost as exc:
            raise self._unavailable("evict_domain", exc) from exc
        if outcome == "busy":
            return Step(BUSY, count=int(n))
        return Step(APPLIED, value=None if n is None else int(n))

    def sweep(self, limit: int | None = None) -> int:
        """Delete due records in batches of at most 1000 rows, each one statement; also drops
        certificates whose retention ended. Returns how many records went."""
        total = 0
        while True:
            batch = 1000 if limit is None else min(1000, limit - total)
            if batch <= 0:
                return total
            try:
                ((n,),) = self._run("sweep", self._q_sweep, (batch, self._p_now()))
            except _Lost as exc:
                raise self._unavailable("sweep", exc) from exc
            total += int(n)
            if n < batch:
                return total

    # -- waiting ------------------------------------------------------------------------------
    def _listening(self) -> bool:
        """Whether the listener thread is LISTENing; starts one if none runs.

        The thread connects on its own, so a waiter never waits on a connect (a server
        that accepts and never answers held waiters past their timeout, found by review);
        until it listens, waiters poll. A failed connect is retried at most every
        ``_RELISTEN`` seconds."""
        listener = self._listener
        if listener is not None and listener.is_alive():
            return self._listen_conn is not None
        with self._listener_lock:
            if self._closed or self._fork != _fork.generation():
                return False
            if self._listener is not None and self._listener.is_alive():
                return self._listen_conn is not None
            now = time.monotonic()
            if now < self._relisten_at:
                return False
            self._relisten_at = now + _RELISTEN
            self._listen_conn = None
            self._listener = threading.Thread(
                target=self._listen, name="effectfence-pg-listen", daemon=True
            )
            self._listener.start()
            return False

    def _listen(self) -> None:
        try:
            conn = psycopg.connect(self._conninfo, autocommit=True, **self._link)
        except psycopg.Error:
            return  # waiters poll; the next one after _RELISTEN tries again
        try:
            conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self._channel)))
            with self._listener_lock:
                if self._closed:
                    return
                self._listen_conn = conn
            self._waiters.wake_all()  # anything may have changed before the LISTEN
            while not self._closed:
                for note in conn.notifies(timeout=0.25):
                    self._waiters.wake(note.payload)
        except psycopg.Error:
            pass  # the next waiter starts a new listener
        finally:
            self._listen_conn = None
            with contextlib.suppress(Exception):
                conn.close()

    def wait_for_change(self, intent: str, seen: IntentRecord | None, timeout: float) -> bool:
        """Woken by the NOTIFY of the intent's next transition in any process."""
        key = hashlib.md5(intent.encode(), usedforsecurity=False).hexdigest()
        if self._fork != _fork.generation():
            self._forked("wait")  # first: the wait below is on the child's own waiters
        deadline = time.monotonic() + timeout
        return self._waiters.wait(
            key, seen, timeout, lambda: self._watch(intent, deadline), self._listening
        )

    def _watch(self, intent: str, deadline: float | None = None) -> IntentRecord | None:
        """:meth:`get`, registering this process as a waiter for the intent's next
        transition (only a registered intent's transitions send a NOTIFY). A row held by a
        step is waited for until ``deadline`` (monotonic; default: ``timeout`` from now),
        then read as committed."""
        left = self.timeout if deadline is None else deadline - time.monotonic()
        wait_ms = max(1, math.ceil(min(left * 1000, _MAX_LOCK_WAIT_MS)))
        try:
            rows = self._run("watch", self._q_watch, (intent, wait_ms))
        except _Lost as exc:
            raise self._unavailable("watch", exc) from exc
        return self._decode(intent, rows[0][1:]) if rows else None

    # -- lifetime -----------------------------------------------------------------------------
    def close(self) -> None:
        """Close the pool (if the store opened it) and the listener. In a forked child that
        never used the store, the parent's connections are left alone: closing them would
        send a Terminate on sockets the parent still uses (found by review)."""
        if self._closed:
            return
        if self._fork != _fork.generation():
            _fork.abandon(self._pool, self._listen_conn)
            self._closed = True
            return
        self._closed = True
        if getattr(self, "_own_pool", False):
            with contextlib.suppress(Exception):
                self._pool.close()
        listener = getattr(self, "_listener", None)
        if listener is not None:
            listener.join(timeout=2.0)


#: seconds an open that failed waits for its pool's workers to stop
_CLOSE_UNOPENED = 0.2


def _recording(failed: list[str]) -> type[psycopg.Connection[Any]]:
    """The pool's connection class, appending to ``failed`` what each failed connect was
    told, on one line (libpq's words name no password)."""

    class Recording(psycopg.Connection[Any]):
        @classmethod
        def connect(cls, *args: Any, **kwargs: Any) -> Any:
            try:
                return super().connect(*args, **kwargs)
            except psycopg.Error as exc:
                failed.append(str(exc))
                del failed[:-1]  # the last is what is reported
                raise

    return Recording


def _last_words(text: str, exc: BaseException) -> tuple[str, str]:
    """(the pool's last failed connect on one line, what a server said in it): libpq's
    words, which name no password. A URL naming several hosts fails with one line per host:
    each server's FATAL is the server's, the rest (a refused port, a timeout) is libpq's
    (found by review: a refused port was reported as the server's words)."""
    if not text or not isinstance(exc, psycopg_pool.PoolTimeout):
        return "", ""
    said = [ln.split("FATAL:", 1)[1].strip() for ln in text.splitlines() if "FATAL:" in ln]
    last = " ".join(text.split()).split("failed: ", 1)[-1]
    return last[:500], "; ".join(dict.fromkeys(said))[:300]


def _link_options(conninfo: str, timeout: float) -> dict[str, Any]:
    """libpq options bounding how long a connection can hang, where the URL sets none.

    libpq waits for ever by default: a connect to a server that accepts and never answers,
    and a step on a network gone silent (no reset, no reply), blocked its thread until the
    kernel gave up, some fifteen minutes (found by review). ``tcp_user_timeout`` ends a
    connection whose sent bytes stay unacknowledged for ``timeout``; keepalives end one
    waiting for a reply from a peer that stopped answering. A live server, however slow its
    statement, acknowledges both. (Unix sockets ignore all but connect_timeout; a caller's
    pool keeps its own; where a libpq service or PGCONNECT_TIMEOUT sets one, it stands.)
    A step so cut may have applied: the store answers as for any connection lost mid-step."""
    given = conninfo_to_dict(conninfo)
    if "service" in given or os.environ.get("PGSERVICE"):
        # a service file's options count as set too, and keywords passed here would win
        # over them (found by review: keepalives=0 there was turned on): it decides
        return {}
    if os.environ.get("PGCONNECT_TIMEOUT"):
        given["connect_timeout"] = os.environ["PGCONNECT_TIMEOUT"]
    whole = max(1, math.ceil(timeout))
    wanted: dict[str, Any] = {
        "connect_timeout": max(2, whole),  # libpq's least
        "keepalives": 1,
        "keepalives_idle": max(1, whole // 2),
        "keepalives_interval": max(1, whole // 6),
        "keepalives_count": 3,
        "tcp_user_timeout": whole * 1000,
    }
    return {k: v for k, v in wanted.items() if k not in given}


def _hung_up(conn: psycopg.Connection[Any]) -> bool:
    """An idle pooled connection with something to read was closed by the server (a
    restart, ``pg_terminate_backend``): the server sent its FATAL and hung up. Checked before
    a statement is sent (one poll, no round trip), so such a connection costs a reconnect,
    not an ambiguous step."""
    try:
        fd = conn.fileno()
        if _POLL is not None:  # select() refuses descriptors past 1023: every connection
            # of a process holding that many looked hung up, and was replaced on every
            # step (found by review: 85 connections opened for 20 steps)
            poller = _POLL()
            poller.register(fd, select.POLLIN | select.POLLPRI | select.POLLERR | select.POLLHUP)
            return bool(poller.poll(0))
        return bool(select.select([fd], [], [], 0)[0])
    except (OSError, ValueError, psycopg.Error):
        return True


_POLL = getattr(select, "poll", None)  # not on Windows, where select() takes any socket


def _cert_of(params: Sequence[Any]) -> Any:
    """The certificate of a ``complete`` step's parameters (after intent, token, fingerprint)."""
    return cert_from_json(params[3])

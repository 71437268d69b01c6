-- Allot's accounting ledger: the durable history of what was configured, granted, spent, stranded and
-- admitted in fallback. etcd holds the live state; this is the record operators and drills read.
--
-- Portable SQL: the same file runs on SQLite (the default) and PostgreSQL (production).
-- Times are epoch milliseconds; token amounts are whole tokens. Both are BIGINT.

-- Every change of a pool's configuration, with who made it.
CREATE TABLE pool_config_history (
    change_id      TEXT    NOT NULL PRIMARY KEY, -- UUID v7 minted by the allocator
    tenant         TEXT    NOT NULL,
    pool           TEXT    NOT NULL,
    version        BIGINT  NOT NULL,             -- the pool's version after the change (0 = deleted)
    actor          TEXT    NOT NULL,
    changed_at_ms  BIGINT  NOT NULL,
    config_json    TEXT    NOT NULL              -- the spec as stored; '{}' for a deletion
);
CREATE INDEX pool_config_history_by_pool ON pool_config_history (tenant, pool, changed_at_ms);

-- Every published policy bundle, immutable.
CREATE TABLE policy_bundles (
    version        BIGINT  NOT NULL PRIMARY KEY,
    checksum       TEXT    NOT NULL,
    published_at   TEXT    NOT NULL,
    actor          TEXT    NOT NULL,
    stored_at_ms   BIGINT  NOT NULL,
    bundle_json    TEXT    NOT NULL
);

-- Every grant, as committed in etcd (copied here after commit; etcd is authoritative).
CREATE TABLE grants (
    lease_id         TEXT    NOT NULL PRIMARY KEY,
    tenant           TEXT    NOT NULL,
    pool             TEXT    NOT NULL,
    region           TEXT    NOT NULL,
    epoch            BIGINT  NOT NULL,
    window_start_ms  BIGINT  NOT NULL,
    window_end_ms    BIGINT  NOT NULL,
    granted          BIGINT  NOT NULL,
    expires_at_ms    BIGINT  NOT NULL
);
CREATE INDEX grants_by_window ON grants (tenant, pool, window_start_ms);

-- Every report an agent sent, kept once per report id (reports are retried).
CREATE TABLE lease_reports (
    report_id          TEXT    NOT NULL PRIMARY KEY,
    region             TEXT    NOT NULL,
    tenant             TEXT    NOT NULL,
    pool               TEXT    NOT NULL,
    window_start_ms    BIGINT  NOT NULL,
    received_at_ms     BIGINT  NOT NULL,
    fallback_admitted  BIGINT  NOT NULL,
    leases_json        TEXT    NOT NULL
);

-- What each lease spent: its cumulative spend (the largest reported), and whether the agent sent the
-- lease's final report. An expired lease without a final report is "unreported", not "stranded".
CREATE TABLE lease_spend (
    lease_id         TEXT    NOT NULL PRIMARY KEY,
    spent            BIGINT  NOT NULL,
    final_report     BIGINT  NOT NULL,           -- 1 once the agent reported the lease as ended
    updated_at_ms    BIGINT  NOT NULL
);

-- Fallback admits per region and window (cumulative, the largest reported).
CREATE TABLE fallback_admits (
    tenant           TEXT    NOT NULL,
    pool             TEXT    NOT NULL,
    region           TEXT    NOT NULL,
    window_start_ms  BIGINT  NOT NULL,
    admitted         BIGINT  NOT NULL,
    PRIMARY KEY (tenant, pool, region, window_start_ms)
);

-- Retention: the leader removes what the ledger no longer needs, in bounded batches.
--
-- Raw reports (the JSON agents sent) go after the raw retention; nothing reads them after their
-- effect is in lease_spend and fallback_admits, but the regions view and retried reports, which
-- are re-applied harmlessly (every amount kept is the largest reported). A window's raw rows are
-- rolled up into window_amounts (below) after the raw retention. Rolled-up windows and window
-- checks go after the rollup retention, by when their window ended.
CREATE INDEX bound_checks_by_end ON bound_checks (window_end_ms);

-- Agent sessions go after the rollup retention of inactivity. A region that ever had an agent is
-- marked here, so an agent starting after every row of its region was removed is not taken for
-- the region's first (whose predecessor is clean by definition): it is judged as after an unclean
-- end, which costs at most its window's fallback allowance and never re-opens it.
CREATE TABLE agent_session_regions (
    region                TEXT    NOT NULL PRIMARY KEY,
    first_started_at_ms   BIGINT  NOT NULL
);
INSERT INTO agent_session_regions (region, first_started_at_ms)
    SELECT region, MIN(started_at_ms) FROM agent_sessions GROUP BY region;

-- Per-window amounts rolled up from the raw rows (grants, lease_spend and the per-window admits
-- tables) once a window ended more than the raw retention ago; the raw rows of the window are
-- removed in the same transaction. One row a region of a window. The windows view reads the two
-- as one: a window's lease figures from here once rolled up, its admits the larger of here and a
-- raw row a late report wrote since (rolled up again the next round). Kept for the rollup
-- retention after the window ended (after it started, for a window with admits only, whose end
-- the ledger does not know).
CREATE TABLE window_amounts (
    tenant             TEXT    NOT NULL,
    pool               TEXT    NOT NULL,
    window_start_ms    BIGINT  NOT NULL,
    window_end_ms      BIGINT  NOT NULL,
    region             TEXT    NOT NULL,
    granted            BIGINT  NOT NULL,
    spent              BIGINT  NOT NULL,
    stranded           BIGINT  NOT NULL,
    unreported         BIGINT  NOT NULL,
    fallback_admitted  BIGINT  NOT NULL,
    shadow_admitted    BIGINT  NOT NULL,
    settle_debt        BIGINT  NOT NULL,
    written_off        BIGINT  NOT NULL,
    rolled_at_ms       BIGINT  NOT NULL,
    PRIMARY KEY (tenant, pool, window_start_ms, region)
);
CREATE INDEX window_amounts_by_end ON window_amounts (window_end_ms);

-- How the rollup finds windows past the raw retention.
CREATE INDEX grants_by_end ON grants (window_end_ms);
CREATE INDEX fallback_admits_by_start ON fallback_admits (window_start_ms);
CREATE INDEX shadow_admits_by_start ON shadow_admits (window_start_ms);
CREATE INDEX settle_debts_by_start ON settle_debts (window_start_ms);
CREATE INDEX written_off_by_start ON written_off (window_start_ms);

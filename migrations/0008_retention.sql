-- Retention: the leader removes what the ledger no longer needs, in bounded batches.
--
-- Raw reports (the JSON agents sent) go after the raw retention; nothing reads them after their
-- effect is in lease_spend and fallback_admits, but the regions view and retried reports, which
-- are re-applied harmlessly (every amount kept is the largest reported).
-- Window checks go after the rollup retention, by when their window ended.
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

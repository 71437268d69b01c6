-- Every window of every pool is checked against its overshoot bound once it has ended and settled,
-- and again for a while as late reports arrive: one row a window (a later check, by this leader or
-- the next, updates it). A row whose admitted exceeds its bound is a violation.
CREATE TABLE bound_checks (
    tenant           TEXT    NOT NULL,
    pool             TEXT    NOT NULL,
    window_start_ms  BIGINT  NOT NULL,
    window_end_ms    BIGINT  NOT NULL,
    admitted         BIGINT  NOT NULL,
    bound            BIGINT  NOT NULL,
    checked_at_ms    BIGINT  NOT NULL,
    PRIMARY KEY (tenant, pool, window_start_ms)
);

CREATE INDEX bound_checks_violations ON bound_checks (checked_at_ms) WHERE admitted > bound;

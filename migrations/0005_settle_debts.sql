-- Metered requests settle their actual cost after the response. What a region's leases cannot pay
-- at once is debt, paid first from its next leases: per region and window, the most debt carried
-- (consumed beyond the admits until paid; bounded by the pool's settleDebtPerRegion), and what was
-- consumed beyond that bound and never charged (written off). Cumulative per window; the largest
-- value reported is kept, as for fallback admits.
CREATE TABLE settle_debts (
    tenant           TEXT    NOT NULL,
    pool             TEXT    NOT NULL,
    region           TEXT    NOT NULL,
    window_start_ms  BIGINT  NOT NULL,
    admitted         BIGINT  NOT NULL,
    PRIMARY KEY (tenant, pool, region, window_start_ms)
);

CREATE TABLE written_off (
    tenant           TEXT    NOT NULL,
    pool             TEXT    NOT NULL,
    region           TEXT    NOT NULL,
    window_start_ms  BIGINT  NOT NULL,
    admitted         BIGINT  NOT NULL,
    PRIMARY KEY (tenant, pool, region, window_start_ms)
);

-- What a shadow global rule would have spent: per region and window, the tokens of requests that a
-- pool in shadow mode counted without spending (cumulative; the largest value reported is kept, as
-- for fallback admits). Read beside the pool's limit, it says what enforcing the pool would have
-- denied.
CREATE TABLE shadow_admits (
    tenant           TEXT    NOT NULL,
    pool             TEXT    NOT NULL,
    region           TEXT    NOT NULL,
    window_start_ms  BIGINT  NOT NULL,
    admitted         BIGINT  NOT NULL,
    PRIMARY KEY (tenant, pool, region, window_start_ms)
);

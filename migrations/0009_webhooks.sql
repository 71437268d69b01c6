-- Threshold webhooks: an operator's endpoint for a tenant (every pool of it; pool NULL) or one pool,
-- the percentages of a window's quota it hears about (comma-separated, ascending), and the secret
-- deliveries are signed with. After a rotation the previous secret still signs until
-- previous_secret_until_ms, so receivers can switch without missing a delivery.
CREATE TABLE webhooks (
    id                        TEXT    NOT NULL PRIMARY KEY,
    url                       TEXT    NOT NULL,
    tenant                    TEXT    NOT NULL,
    pool                      TEXT,
    thresholds                TEXT    NOT NULL,
    secret                    TEXT    NOT NULL,
    previous_secret           TEXT,
    previous_secret_until_ms  BIGINT,
    created_at_ms             BIGINT  NOT NULL,
    created_by                TEXT    NOT NULL
);

-- One row per event, keyed by an id made from what it is about (webhook, tenant, pool, window,
-- threshold): a crossing found again, by this leader or the next, is the same row. The row is the
-- delivery's state: pending until delivered_at_ms or failed_at_ms is set, next tried at
-- next_attempt_at_ms.
CREATE TABLE webhook_events (
    event_id            TEXT    NOT NULL PRIMARY KEY,
    webhook_id          TEXT    NOT NULL,
    payload             TEXT    NOT NULL,
    created_at_ms       BIGINT  NOT NULL,
    attempts            BIGINT  NOT NULL,
    next_attempt_at_ms  BIGINT  NOT NULL,
    delivered_at_ms     BIGINT,
    failed_at_ms        BIGINT,
    last_status         BIGINT,
    last_error          TEXT
);

CREATE INDEX webhook_events_due ON webhook_events (next_attempt_at_ms);
CREATE INDEX webhook_events_by_webhook ON webhook_events (webhook_id, created_at_ms);

-- The audit log: every change an operator made through the API (pools, policies, tokens), with who
-- made it and the version it produced. Actors are `<role>:<token id>`, never a token.
CREATE TABLE audit_log (
    entry_id     TEXT    NOT NULL PRIMARY KEY, -- UUID v7 minted by the allocator (sorts by time)
    at_ms        BIGINT  NOT NULL,
    actor        TEXT    NOT NULL,
    action       TEXT    NOT NULL,             -- pool.put, pool.delete, policy.publish, policy.promote, token.mint, token.revoke
    target       TEXT    NOT NULL,             -- tenant/pool, policy version, or token id
    version      BIGINT  NOT NULL,             -- the version after the change (0 when none applies)
    detail       TEXT    NOT NULL              -- short JSON: what changed (never a secret)
);
CREATE INDEX audit_log_by_time ON audit_log (at_ms);

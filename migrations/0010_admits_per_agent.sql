-- Per-window figures per agent: a region may run several agents, each admitting its own share of
-- the region's fallback allowance (and carrying its own shadow counts and settle debt). Each agent
-- reports its own cumulative figure, so the ledger keeps one row per agent (the larger reported
-- kept, as before) and a region's figure is the sum over its agents.
--
-- agent_id is the agent's id as its reports name it; '' for reports that name none (agents that
-- predate this, and every row carried over from before it): those keep one row per region, the
-- larger reported, as they always did.

CREATE TABLE fallback_admits_by_agent (
    tenant           TEXT    NOT NULL,
    pool             TEXT    NOT NULL,
    region           TEXT    NOT NULL,
    window_start_ms  BIGINT  NOT NULL,
    agent_id         TEXT    NOT NULL,
    admitted         BIGINT  NOT NULL,
    PRIMARY KEY (tenant, pool, region, window_start_ms, agent_id)
);
INSERT INTO fallback_admits_by_agent (tenant, pool, region, window_start_ms, agent_id, admitted)
    SELECT tenant, pool, region, window_start_ms, '', admitted FROM fallback_admits;
DROP TABLE fallback_admits;
ALTER TABLE fallback_admits_by_agent RENAME TO fallback_admits;
CREATE INDEX fallback_admits_by_start ON fallback_admits (window_start_ms);

CREATE TABLE shadow_admits_by_agent (
    tenant           TEXT    NOT NULL,
    pool             TEXT    NOT NULL,
    region           TEXT    NOT NULL,
    window_start_ms  BIGINT  NOT NULL,
    agent_id         TEXT    NOT NULL,
    admitted         BIGINT  NOT NULL,
    PRIMARY KEY (tenant, pool, region, window_start_ms, agent_id)
);
INSERT INTO shadow_admits_by_agent (tenant, pool, region, window_start_ms, agent_id, admitted)
    SELECT tenant, pool, region, window_start_ms, '', admitted FROM shadow_admits;
DROP TABLE shadow_admits;
ALTER TABLE shadow_admits_by_agent RENAME TO shadow_admits;
CREATE INDEX shadow_admits_by_start ON shadow_admits (window_start_ms);

CREATE TABLE settle_debts_by_agent (
    tenant           TEXT    NOT NULL,
    pool             TEXT    NOT NULL,
    region           TEXT    NOT NULL,
    window_start_ms  BIGINT  NOT NULL,
    agent_id         TEXT    NOT NULL,
    admitted         BIGINT  NOT NULL,
    PRIMARY KEY (tenant, pool, region, window_start_ms, agent_id)
);
INSERT INTO settle_debts_by_agent (tenant, pool, region, window_start_ms, agent_id, admitted)
    SELECT tenant, pool, region, window_start_ms, '', admitted FROM settle_debts;
DROP TABLE settle_debts;
ALTER TABLE settle_debts_by_agent RENAME TO settle_debts;
CREATE INDEX settle_debts_by_start ON settle_debts (window_start_ms);

CREATE TABLE written_off_by_agent (
    tenant           TEXT    NOT NULL,
    pool             TEXT    NOT NULL,
    region           TEXT    NOT NULL,
    window_start_ms  BIGINT  NOT NULL,
    agent_id         TEXT    NOT NULL,
    admitted         BIGINT  NOT NULL,
    PRIMARY KEY (tenant, pool, region, window_start_ms, agent_id)
);
INSERT INTO written_off_by_agent (tenant, pool, region, window_start_ms, agent_id, admitted)
    SELECT tenant, pool, region, window_start_ms, '', admitted FROM written_off;
DROP TABLE written_off;
ALTER TABLE written_off_by_agent RENAME TO written_off;
CREATE INDEX written_off_by_start ON written_off (window_start_ms);

-- Which agent, and which run of it, sent each report (NULL: the report named none).
ALTER TABLE lease_reports ADD COLUMN agent_id TEXT;
ALTER TABLE lease_reports ADD COLUMN incarnation TEXT;

-- A window is also over its bound when one region's agents together admitted more in fallback than
-- the region's allowance (agents that each took a larger share than the region's agents leave
-- them): fallback_excess is the tokens beyond it, over all such regions, and excess_regions names
-- them (comma-separated). The violations' partial index covers both kinds.
ALTER TABLE bound_checks ADD COLUMN fallback_excess BIGINT NOT NULL DEFAULT 0;
ALTER TABLE bound_checks ADD COLUMN excess_regions TEXT NOT NULL DEFAULT '';
DROP INDEX bound_checks_violations;
CREATE INDEX bound_checks_violations ON bound_checks (checked_at_ms)
    WHERE admitted > bound OR fallback_excess > 0;

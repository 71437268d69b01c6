-- One row per agent (region, agent id): its latest run, whether that run ended cleanly (every
-- fallback admit reported before it stopped), and the verdict given to that run when it started
-- about the run before it. A run that crashed never ends, so the next run of the agent learns that
-- its predecessor may have admitted fallback the ledger never saw. unclean_start_ms is when the
-- latest run that followed an unclean end started: any window containing it may hold such admits,
-- whatever later runs did (they cannot know them either). Booleans are 0/1 integers.
CREATE TABLE agent_sessions (
    region             TEXT    NOT NULL,
    agent_id           TEXT    NOT NULL,
    incarnation        TEXT    NOT NULL,
    started_at_ms      BIGINT  NOT NULL,
    ended_at_ms        BIGINT,
    predecessor_ended  BIGINT  NOT NULL,
    unclean_start_ms   BIGINT,
    PRIMARY KEY (region, agent_id)
);

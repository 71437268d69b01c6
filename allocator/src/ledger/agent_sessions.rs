//! Agent sessions: each agent's latest run and whether the run before it ended cleanly. An agent
//! without a state directory forgets, when it crashes, the fallback it admitted but had not yet
//! reported; its next run asks here whether that can have happened, and if so counts its
//! allowance of the window it starts in as used. One row per (region, agent id); the verdict a run
//! receives is stored with it, so a retried start gets the same answer. Rows of agents inactive
//! past the rollup retention are removed ([`super::retention`]); `agent_session_regions` keeps
//! that the region had agents.

use allot_shared::ids::{AgentId, AgentIncarnation, RegionId};
use allot_shared::wire::{AgentSession, AgentSessionStarted};

use super::{Database, Ledger, LedgerError, i64_of, u64_of};

/// Records `session` as its agent's latest run (at `now_ms`, its first start) and answers how the
/// run before it ended. `$1` region, `$2` agent id, `$3` incarnation, `$4` now (both databases
/// read `$N`, each number as often as it appears).
const START_SQL: &str = "\
INSERT INTO agent_sessions
    (region, agent_id, incarnation, started_at_ms, ended_at_ms, predecessor_ended, unclean_start_ms)
VALUES ($1, $2, $3, $4, NULL,
        CASE WHEN EXISTS (SELECT 1 FROM agent_session_regions WHERE region = $1) THEN 0 ELSE 1 END,
        CASE WHEN EXISTS (SELECT 1 FROM agent_session_regions WHERE region = $1) THEN $4 ELSE NULL END)
ON CONFLICT (region, agent_id) DO UPDATE SET
    unclean_start_ms = CASE
        WHEN agent_sessions.incarnation = excluded.incarnation THEN agent_sessions.unclean_start_ms
        WHEN agent_sessions.ended_at_ms IS NULL THEN excluded.started_at_ms
        ELSE agent_sessions.unclean_start_ms END,
    predecessor_ended = CASE
        WHEN agent_sessions.incarnation = excluded.incarnation THEN agent_sessions.predecessor_ended
        WHEN agent_sessions.ended_at_ms IS NULL THEN 0
        ELSE 1 END,
    started_at_ms = CASE
        WHEN agent_sessions.incarnation = excluded.incarnation THEN agent_sessions.started_at_ms
        ELSE excluded.started_at_ms END,
    ended_at_ms = CASE
        WHEN agent_sessions.incarnation = excluded.incarnation THEN agent_sessions.ended_at_ms
        ELSE NULL END,
    incarnation = excluded.incarnation
RETURNING predecessor_ended, started_at_ms, unclean_start_ms";

/// Marks the region as having had an agent (after [`START_SQL`], in its transaction): a later
/// agent of the region is never taken for its first, even once this one's row is removed.
const MARK_REGION_SQL: &str = "\
INSERT INTO agent_session_regions (region, first_started_at_ms) VALUES ($1, $2)
ON CONFLICT (region) DO NOTHING";

/// Marks the run ended, if it is still its agent's latest.
const END_SQL: &str = "\
UPDATE agent_sessions SET ended_at_ms = $1
WHERE region = $2 AND agent_id = $3 AND incarnation = $4";

#[derive(sqlx::FromRow)]
struct Started {
    predecessor_ended: i64,
    started_at_ms: i64,
    unclean_start_ms: Option<i64>,
}

impl Ledger {
    /// Starts `session` at `now_ms` (idempotent for one incarnation) and says how the agent's run
    /// before it ended: cleanly when it said so, or when no agent of the region ever ran; and when
    /// the latest run of the agent that followed an unclean end started.
    pub async fn start_agent_session(
        &self,
        session: &AgentSession,
        now_ms: u64,
    ) -> Result<AgentSessionStarted, LedgerError> {
        let (region, agent, incarnation) = texts(session);
        // One statement for either database's pool.
        // The verdict and the region's mark in one transaction.
        macro_rules! start {
            ($pool:expr) => {{
                let mut transaction = $pool.begin().await?;
                let started: Started = sqlx::query_as(START_SQL)
                    .bind(&region)
                    .bind(&agent)
                    .bind(&incarnation)
                    .bind(i64_of(now_ms))
                    .fetch_one(&mut *transaction)
                    .await?;
                sqlx::query(MARK_REGION_SQL)
                    .bind(&region)
                    .bind(i64_of(now_ms))
                    .execute(&mut *transaction)
                    .await?;
                transaction.commit().await?;
                started
            }};
        }
        let started: Started = match &self.database {
            Database::Sqlite(pool) => start!(pool),
            Database::Postgres(pool) => start!(pool),
        };
        Ok(AgentSessionStarted {
            predecessor_ended_cleanly: started.predecessor_ended == 1,
            started_at_ms: u64_of(started.started_at_ms),
            unclean_since_ms: started.unclean_start_ms.map(u64_of),
        })
    }

    /// Ends `session` at `now_ms`; false when it is not its agent's latest run (a later one
    /// started, or it never did).
    pub async fn end_agent_session(
        &self,
        session: &AgentSession,
        now_ms: u64,
    ) -> Result<bool, LedgerError> {
        let (region, agent, incarnation) = texts(session);
        macro_rules! end {
            ($pool:expr) => {
                sqlx::query(END_SQL)
                    .bind(i64_of(now_ms))
                    .bind(&region)
                    .bind(&agent)
                    .bind(&incarnation)
                    .execute($pool)
                    .await?
                    .rows_affected()
            };
        }
        let ended = match &self.database {
            Database::Sqlite(pool) => end!(pool),
            Database::Postgres(pool) => end!(pool),
        };
        Ok(ended == 1)
    }
}

fn texts(session: &AgentSession) -> (String, String, String) {
    let AgentSession {
        region,
        agent_id,
        incarnation,
    } = session;
    (
        RegionId::as_str(region).to_owned(),
        AgentId::as_str(agent_id).to_owned(),
        AgentIncarnation::to_string(incarnation),
    )
}

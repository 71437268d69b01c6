//! Every message that crosses the allocator-agent link, defined once: the allocator's API parses
//! and answers these types, and the agent's client sends and reads them.
//!
//! | call | request | answer |
//! | --- | --- | --- |
//! | `GET /v1/pools/{tenant}/{pool}/terms[?region=]` | | [`PoolTerms`] (with [`FallbackInWindow`] for a region) |
//! | `POST /v1/grants` | [`GrantBody`] | [`GrantAnswer`] |
//! | `POST /v1/reports` | [`Report`] ([`ReportLease`] lines) | [`ReportReceipt`] |
//! | `POST /v1/policies/status` | [`AgentStatus`] | 204 |
//! | `POST /v1/agent-sessions` | [`AgentSession`] | [`AgentSessionStarted`] |
//! | `POST /v1/agent-sessions/end` | [`AgentSession`] | [`AgentSessionEnded`] |
//! | `GET /v1/policies/current?region=` | | the bundle's wire form (`policy::PolicyBundle::to_json`) |
//!
//! Requests are parsed strictly by the allocator (`deny_unknown_fields`: a misspelt field is a 400
//! naming it, never silently ignored). Answers are read leniently by agents (unknown fields are
//! ignored, missing optional ones take their defaults), so an allocator may add to an answer before
//! every agent knows of it.

use serde::{Deserialize, Serialize};

use crate::ids::{AgentId, AgentIncarnation, Epoch, LeaseId, PoolId, RegionId, TenantId};
use crate::shards::ShardId;

/// Calendar windows as pool specs and terms write them: `{"calendar": "month", "timeZone":
/// "Europe/Berlin"}` (`calendar`: `day`, `week` or `month`; an IANA time zone name).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct CalendarWindowSpec {
    /// `day`, `week` (from Monday) or `month`.
    pub calendar: String,
    /// The IANA time zone the calendar is read in.
    pub time_zone: String,
}

impl CalendarWindowSpec {
    /// The window spec, or the field at fault (`window.calendar`, `window.timeZone`).
    pub fn to_spec(&self) -> Result<crate::window::WindowSpec, crate::FieldError> {
        let unit = crate::window::CalendarUnit::parse(&self.calendar).ok_or_else(|| {
            crate::FieldError::new(
                "window.calendar",
                format!("must be day, week or month, got {:?}", self.calendar),
            )
        })?;
        let calendar = crate::window::CalendarWindow::new(unit, &self.time_zone)
            .map_err(|e| crate::FieldError::new("window.timeZone", e.to_string()))?;
        Ok(crate::window::WindowSpec::Calendar(calendar))
    }

    /// The wire form of `calendar`.
    pub fn of(calendar: &crate::window::CalendarWindow) -> Self {
        Self {
            calendar: calendar.unit().as_str().to_owned(),
            time_zone: calendar.time_zone().to_owned(),
        }
    }
}

/// A pool's terms as the allocator gives them to agents (`GET /v1/pools/{tenant}/{pool}/terms`):
/// the operator's terms (the allocator's `PoolSpec`) with the version they were written as and,
/// asked for one region, its fallback admits so far. A wire message, so agents of another version
/// read it tolerantly (`windowMs` is always set, for calendar windows the longest one); agents
/// validate it into a [`PoolConfig`](crate::lease::PoolConfig) before using it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct PoolTerms {
    /// `G`, tokens per window.
    #[serde(rename = "limit")]
    pub limit_tokens: u64,
    /// Window length, ms; for calendar windows, the longest one can be.
    pub window_ms: u64,
    /// Calendar windows, when the pool's windows are days, weeks or months in a time zone (then
    /// they, not `windowMs`, cut the windows).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<CalendarWindowSpec>,
    /// Largest grant, tokens.
    #[serde(rename = "chunk")]
    pub chunk_tokens: u64,
    /// Lease TTL before clamping, ms.
    pub lease_ttl_ms: u64,
    /// Tokens a region may admit per window while it cannot reach the allocator.
    #[serde(rename = "fallbackPerRegion")]
    pub fallback_per_region_tokens: u64,
    /// Debt a region may carry per window from metered requests settled above their estimate,
    /// tokens (0 or absent: none; what the leases cannot pay at once is written off).
    #[serde(
        default,
        rename = "settleDebtPerRegion",
        skip_serializing_if = "crate::wire::is_zero"
    )]
    pub settle_debt_per_region_tokens: u64,
    /// Regions allowed to take grants.
    pub regions: Vec<RegionId>,
    /// The configuration's version.
    pub version: u64,
    /// When asked for a region: what it has reported admitting in fallback in the current window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_in_window: Option<FallbackInWindow>,
    /// The override of `limit` in force when the terms were answered: the pool's `G` until it
    /// ends (the allocator grants against it; agents show it).
    #[serde(default, rename = "override", skip_serializing_if = "Option::is_none")]
    pub limit_override: Option<crate::overrides::PoolOverride>,
}

/// Most pools one `POST /v1/terms/batch` call may ask about.
pub const MAX_TERMS_PER_BATCH: usize = 256;

/// One pool a `POST /v1/terms/batch` call asks the terms of.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TermsAsk {
    /// The tenant.
    pub tenant: TenantId,
    /// The pool.
    pub pool: PoolId,
}

/// `POST /v1/terms/batch` body: the terms of several pools in one call (an agent's first
/// requests for many pools at once), each answered as `GET /v1/pools/{tenant}/{pool}/terms`
/// answers it with `region` and `agentId` as its query.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct TermsBatch {
    /// The asking region: each answer adds its fallback admitted so far in the window.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<RegionId>,
    /// The asking agent (with `region`): the fallback admitted is its own.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub agent_id: Option<AgentId>,
    /// The pools, at most [`MAX_TERMS_PER_BATCH`].
    #[schema(max_items = 256)]
    pub pools: Vec<TermsAsk>,
}

/// `POST /v1/terms/batch` answer: one result per pool, in the order asked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TermsBatchAnswer {
    /// Each pool's result, in the order of the call's `pools`.
    pub results: Vec<TermsResult>,
}

/// One pool's result in a terms batch: its terms, or the problem the single route would have
/// answered (404: no such pool), its `field` prefixed `pools[i].`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct TermsResult {
    /// The pool's terms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub terms: Option<PoolTerms>,
    /// Why the pool has no terms to give.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub problem: Option<crate::contract::Problem>,
}

/// A region's fallback admits in one window, as the allocator's ledger holds them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct FallbackInWindow {
    /// The window's start, epoch ms.
    pub window_start_ms: u64,
    /// Tokens admitted in fallback so far, as reported.
    #[serde(rename = "admitted")]
    pub admitted_tokens: u64,
}

impl PoolTerms {
    /// `G` at `now_ms`: the override's while it is in force, else `limit`.
    pub fn limit_at(&self, now_ms: u64) -> u64 {
        crate::overrides::limit_at(self.limit_tokens, self.limit_override.as_slice(), now_ms)
    }

    /// How the pool's windows are cut: calendar windows when given, else `windowMs` (`None` when
    /// neither is valid).
    pub fn window_spec(&self) -> Option<crate::window::WindowSpec> {
        match &self.window {
            Some(calendar) => calendar.to_spec().ok(),
            None => std::num::NonZeroU64::new(self.window_ms).map(crate::window::WindowSpec::Fixed),
        }
    }
}

/// `POST /v1/grants` body: a region asks a pool for tokens.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GrantBody {
    /// Idempotency key, a UUID v7: asking again with it returns what was granted.
    pub lease_id: LeaseId,
    /// The tenant.
    pub tenant: TenantId,
    /// The pool.
    pub pool: PoolId,
    /// The asking region.
    pub region: RegionId,
    /// Tokens wanted (at least 1).
    #[serde(rename = "want")]
    #[schema(minimum = 1)]
    pub want_tokens: u64,
}

/// `POST /v1/grants` answer: a grant (idempotent by lease id) and when this answer was made.
#[derive(
    Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "camelCase")]
pub struct GrantAnswer {
    /// The request's lease id.
    pub lease_id: LeaseId,
    /// The region it was granted to.
    pub region: RegionId,
    /// Tokens granted (0: the pool is exhausted until `retryAfterMs` from now).
    #[serde(rename = "granted")]
    pub granted_tokens: u64,
    /// The granting leader's epoch.
    pub epoch: Epoch,
    /// Window start, epoch ms.
    pub window_start_ms: u64,
    /// Window end, epoch ms.
    pub window_end_ms: u64,
    /// No token may be spent at or after this instant, epoch ms (the allocator's clock).
    pub expires_at_ms: u64,
    /// When nothing was granted, ms until the next window; else 0.
    pub retry_after_ms: u64,
    /// When it was granted (the allocator's clock), epoch ms; 0 from an allocator that does not
    /// say.
    #[serde(default)]
    pub issued_at_ms: u64,
    /// When this answer was made (the allocator's clock), epoch ms: the issue time for a fresh
    /// grant, later for a lease id asked again after a lost answer. `expiresAtMs - answeredAtMs`
    /// is what is left of the lease when the answer leaves: agents time the lease from their own
    /// ask, so a recovered grant is never spent past its end. 0 from an allocator that does not
    /// say.
    #[serde(default)]
    pub answered_at_ms: u64,
    /// What the window had left to grant after this grant (as of `issuedAtMs`), tokens: the
    /// allocator's view of the pool's remaining quota. Absent from an allocator that does not say.
    #[serde(default, rename = "ungranted", skip_serializing_if = "Option::is_none")]
    pub ungranted_tokens: Option<u64>,
    /// True when the allocator takes back what the lease leaves unspent: its final report may say
    /// how many tokens its holder will never spend ([`ReportLease::unspent_tokens`]), and those
    /// can be granted again in the lease's window. Absent (false) from an allocator that does not,
    /// which refuses the field.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub returnable: bool,
    /// The version of the pool's terms ([`PoolTerms::version`]) the allocator granted under:
    /// an agent holding older terms fetches them again, and one holding these need not ask
    /// until the next grant says otherwise. Absent (0) from an allocator that does not say.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub terms_version: u64,
}

impl GrantAnswer {
    /// The allocator's clock when it answered: `answeredAtMs`, or `issuedAtMs` from an allocator
    /// that does not say (0: neither).
    pub fn answered_at_ms(&self) -> u64 {
        if self.answered_at_ms != 0 {
            self.answered_at_ms
        } else {
            self.issued_at_ms
        }
    }
}

/// Most grants one `POST /v1/grants/batch` call may ask for.
pub const MAX_GRANTS_PER_BATCH: usize = 256;

/// `POST /v1/grants/batch` body: an agent's renewals of several pools in one call, each decided as
/// `POST /v1/grants` decides it (idempotent by lease id) by its pool's own worker.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct GrantBatch {
    /// The asks, at most [`MAX_GRANTS_PER_BATCH`], one lease id each.
    #[schema(max_items = 256)]
    pub grants: Vec<GrantBody>,
}

/// `POST /v1/grants/batch` answer: one result per ask, in the order sent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct GrantBatchAnswer {
    /// Each ask's result, in the order of the call's `grants`.
    pub results: Vec<GrantResult>,
}

/// One ask's result in a batch: its grant, or why nothing was granted (the problem
/// `POST /v1/grants` would have answered, its `field` prefixed `grants[i].`). A refused ask
/// changed nothing; the others were decided all the same. An ask whose problem is a server's
/// (status 5xx) may have been granted: asking again with the same lease id answers what was.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct GrantResult {
    /// The grant (possibly of nothing: the pool is exhausted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub grant: Option<GrantAnswer>,
    /// Why the ask was not answered with a grant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub problem: Option<crate::contract::Problem>,
}

/// One lease's line in a [`Report`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReportLease {
    /// The lease.
    pub lease_id: LeaseId,
    /// Tokens spent from it so far (cumulative; the ledger keeps the largest value reported).
    #[serde(rename = "spent")]
    pub spent_tokens: u64,
    /// True in the lease's last report (it ended): what is unspent is stranded, unless given back.
    #[serde(default, rename = "final")]
    pub final_report: bool,
    /// In a final line of a lease granted `returnable`: tokens of it that its holder left unspent
    /// and will never spend (none reserved, none held by a gateway), given back to the lease's
    /// window. The allocator takes back at most the grant less `spent`, once per lease, and only
    /// while the lease's window is the pool's current one; the rest is stranded.
    #[serde(
        default,
        rename = "unspent",
        skip_serializing_if = "crate::wire::is_zero"
    )]
    pub unspent_tokens: u64,
}

/// `POST /v1/reports` body: what a region spent and admitted in fallback for one pool and window.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Report {
    /// Idempotency key chosen by the agent (1 to 64 characters).
    #[schema(min_length = 1, max_length = 64)]
    pub report_id: String,
    /// The reporting region.
    pub region: RegionId,
    /// The tenant.
    pub tenant: TenantId,
    /// The pool.
    pub pool: PoolId,
    /// The window the fallback admits belong to, epoch ms.
    pub window_start_ms: u64,
    /// Lease spends.
    #[serde(default)]
    pub leases: Vec<ReportLease>,
    /// Tokens admitted in fallback in this window so far (cumulative).
    #[serde(default, rename = "fallbackAdmitted")]
    pub fallback_admitted_tokens: u64,
    /// Tokens a shadow global rule of this pool counted in this window so far without spending
    /// them (cumulative): what enforcing the pool would have spent.
    #[serde(
        default,
        rename = "shadowAdmitted",
        skip_serializing_if = "crate::wire::is_zero"
    )]
    pub shadow_admitted_tokens: u64,
    /// The most debt from settled metered requests the region carried in this window, tokens:
    /// consumed, to be paid from later leases (at most `settleDebtPerRegion`).
    #[serde(
        default,
        rename = "settleDebt",
        skip_serializing_if = "crate::wire::is_zero"
    )]
    pub settle_debt_tokens: u64,
    /// Tokens consumed by metered requests beyond the debt the region may carry, in this window
    /// (cumulative): never charged, counted here.
    #[serde(
        default,
        rename = "writtenOff",
        skip_serializing_if = "crate::wire::is_zero"
    )]
    pub written_off_tokens: u64,
    /// The reporting agent's id (as in its session). The ledger keeps the fallback, shadow and
    /// settle figures per agent, and a region's figure is the sum over its agents; a report that
    /// names no agent is counted as one unnamed agent of its region (its largest figure kept).
    #[serde(default, rename = "agentId", skip_serializing_if = "Option::is_none")]
    pub agent_id: Option<AgentId>,
    /// The run of the agent that sent it (as in its session; only with `agentId`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub incarnation: Option<AgentIncarnation>,
}

/// For `skip_serializing_if`: a zero amount is not sent (older allocators refuse unknown fields).
pub fn is_zero(amount: &u64) -> bool {
    *amount == 0
}

impl Report {
    /// The report id's bounds: 1 to 64 characters (as the schema counts them, not bytes).
    pub fn check_report_id(&self) -> Result<(), crate::FieldError> {
        let characters = self.report_id.chars().count();
        if (1..=64).contains(&characters) {
            Ok(())
        } else {
            Err(crate::FieldError::new(
                "reportId",
                "must be 1 to 64 characters",
            ))
        }
    }
}

/// `POST /v1/reports` answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReportReceipt {
    /// True when this report id had been received before (nothing was applied again).
    pub duplicate: bool,
    /// Tokens taken back of what the report's final lines left `unspent` (grantable again in
    /// their leases' windows); the rest of it is stranded. Absent: none.
    #[serde(
        default,
        rename = "returned",
        skip_serializing_if = "crate::wire::is_zero"
    )]
    pub returned_tokens: u64,
}

/// Most reports one `POST /v1/reports/batch` call may carry.
pub const MAX_REPORTS_PER_BATCH: usize = 256;
/// Most lease lines one `POST /v1/reports/batch` call may carry, all its reports together.
pub const MAX_LEASE_LINES_PER_BATCH: usize = 10_000;
/// Largest `POST /v1/reports/batch` body, bytes.
pub const MAX_REPORT_BATCH_BYTES: usize = 1024 * 1024;

/// `POST /v1/reports/batch` body: an agent's report round in one call, each report taken as
/// `POST /v1/reports` takes it (once per report id), written to the ledger in one transaction.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ReportBatch {
    /// The reports, at most [`MAX_REPORTS_PER_BATCH`], with at most
    /// [`MAX_LEASE_LINES_PER_BATCH`] lease lines among them.
    #[schema(max_items = 256)]
    pub reports: Vec<Report>,
}

/// `POST /v1/reports/batch` answer: one result per report, in the order sent.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReportBatchAnswer {
    /// Each report's result, in the order of the call's `reports`.
    pub results: Vec<ReportResult>,
}

/// One report's result in a batch: its receipt, or why it was refused (its `field` prefixed
/// `reports[i].`). A refused report changed nothing; the others were taken all the same.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ReportResult {
    /// The receipt of a report taken (or taken before: `duplicate`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub receipt: Option<ReportReceipt>,
    /// Why the report was refused.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub problem: Option<crate::contract::Problem>,
}

/// `POST /v1/policies/status` body: which bundle an agent runs (the allocator stamps when).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AgentStatus {
    /// The agent's region.
    pub region: RegionId,
    /// The agent's id.
    pub agent_id: AgentId,
    /// The bundle version it runs (0: none).
    pub version: u64,
    /// When it said so, epoch ms (set by the allocator).
    #[serde(default)]
    pub reported_at_ms: u64,
    /// The fingerprint of the agent's principal-hash pepper (8 lowercase hex digits; never the
    /// pepper). Agents of one region must agree on it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schema(pattern = "^[0-9a-f]{8}$")]
    pub pepper_fingerprint: Option<String>,
}

/// One run of an agent (`POST /v1/agent-sessions` when it first reaches the allocator, and
/// `POST /v1/agent-sessions/end` when it stops with every fallback admit reported).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct AgentSession {
    /// The agent's region.
    pub region: RegionId,
    /// The agent's id: the same across its restarts, distinct among its region's agents.
    pub agent_id: AgentId,
    /// This run of it.
    pub incarnation: AgentIncarnation,
}

/// `POST /v1/agent-sessions` answer: how the agent's previous run ended. The same for every retry
/// of one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AgentSessionStarted {
    /// Whether the previous run of this agent id ended with every fallback admit reported (or no
    /// agent of the region ever ran before). When false, that run may have admitted fallback the
    /// ledger never saw, up to its allowance, in the window this run starts in.
    pub predecessor_ended_cleanly: bool,
    /// When the allocator first heard of this run, epoch ms.
    pub started_at_ms: u64,
    /// When the latest run of this agent id that followed an unclean end started (this run's
    /// start, when its predecessor did not end cleanly), epoch ms on the allocator's clock. A
    /// window containing it may hold fallback admits nobody reported, whatever the runs after it
    /// did: a run without a journal counts such a window's allowance as used.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unclean_since_ms: Option<u64>,
}

/// `POST /v1/agent-sessions/end` answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AgentSessionEnded {
    /// Whether this run is recorded as ended cleanly (false: a later run of the agent id started
    /// meanwhile, or this one was never started).
    pub ended: bool,
}

/// `GET /v1/shards` answer: how the pools are split into shards and who leads each. An agent sends
/// each pool's calls to the leader of its shard ([`crate::shards::shard_of`] with `shardCount`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ShardMap {
    /// How many shards the pools are split into (fixed for a store).
    pub shard_count: u32,
    /// Every shard, in order.
    pub shards: Vec<ShardLead>,
}

impl ShardMap {
    /// How many shards each leader leads, by node id (shards without a leader left out).
    pub fn led_by(&self) -> std::collections::BTreeMap<&str, usize> {
        let mut led = std::collections::BTreeMap::new();
        for leader in self.shards.iter().filter_map(|s| s.leader.as_ref()) {
            *led.entry(leader.node_id.as_str()).or_default() += 1;
        }
        led
    }
}

/// One shard and who leads it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ShardLead {
    /// The shard.
    pub shard: ShardId,
    /// Its leader, absent while none leads (a failover or a hand-over under way).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub leader: Option<ShardLeader>,
}

/// A shard's leader.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ShardLeader {
    /// The leading allocator's node id.
    pub node_id: String,
    /// Where agents and operators reach it.
    pub url: String,
    /// The epoch its grants for this shard carry.
    pub epoch: Epoch,
}

//! The agent's client of the allocator API: pool terms, grants, reports, policy bundles and status.
//!
//! Off the request path only (renewals, reports, polling). Every call has a deadline; with several
//! allocator URLs it tries the last one that answered first, follows a follower's `503` to the leader
//! it names, and otherwise moves to the next URL, at most once around the list. Where the
//! allocators split the pools into shards (`GET /v1/shards`), grants and reports go to each pool's
//! shard leader first, a batch split into one call per leader. The wire types mirror
//! the allocator's API (`docs/allocator.md`); the end-to-end tests hold the two together.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use allot_shared::ids::{AgentId, LeaseId, PoolId, RegionId, TenantId};
use allot_shared::overrides::OverrideSet;
use allot_shared::policy::{PolicyBundle, parse_bundle};
use allot_shared::shards::{ShardCount, shard_of};
pub use allot_shared::wire::{
    AgentSession, AgentSessionEnded, AgentSessionStarted, AgentStatus, FallbackInWindow,
    GrantAnswer, GrantBatch, GrantBatchAnswer, GrantBody, GrantResult, MAX_GRANTS_PER_BATCH,
    MAX_LEASE_LINES_PER_BATCH, MAX_REPORT_BATCH_BYTES, MAX_REPORTS_PER_BATCH, MAX_TERMS_PER_BATCH,
    PoolTerms, Report, ReportBatch, ReportBatchAnswer, ReportLease, ReportReceipt, ReportResult,
    ShardMap, TermsAsk, TermsBatch, TermsBatchAnswer, TermsResult,
};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

/// Deadline of one allocator call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(2);
/// Largest answer body read from an allocator (the biggest are a policy bundle of at most 1,000
/// rules, and the override set: at most 10,000 overrides of under 300 bytes each); a longer one is
/// refused, not buffered (I10).
pub const MAX_ANSWER_BYTES: usize = 4 << 20;

/// How long an allocator that answered 404 to a batch route is taken to lack it, ms: callers use
/// the one-at-a-time route meanwhile, then try the batch route again (the allocator may have been
/// upgraded).
pub const MISSING_ROUTE_RETRY_MS: u64 = 5 * 60_000;

/// How long a shard map is used before it is read again, ms; an entry refused by an allocator
/// that does not lead its shard has it read again before the next call.
pub const SHARD_MAP_REUSED_MS: u64 = 30_000;

/// Who leads each shard, as last read: where each pool's grants and reports go first.
#[derive(Debug, Default)]
struct ShardRoutes {
    /// The shard count and each shard's leader URL; `None` until read (or from an allocator
    /// without shards).
    leaders: Option<(ShardCount, Vec<Option<String>>)>,
    /// When it was read.
    read_at: Option<tokio::time::Instant>,
    /// Whether an allocator refused an entry as not its shard's leader since.
    stale: bool,
}

/// Remembers that the allocator lacks a route (it answered 404), so a caller with a fallback pays
/// the 404 once per [`MISSING_ROUTE_RETRY_MS`], not on every call.
#[derive(Debug, Default)]
pub struct MissingRoute {
    /// Until when the route is taken to be missing, epoch ms (0: it is not).
    until_ms: AtomicU64,
}

impl MissingRoute {
    /// Whether the route is taken to be missing at `now_ms`.
    pub fn is_missing(&self, now_ms: u64) -> bool {
        now_ms < self.until_ms.load(Ordering::Relaxed)
    }

    /// The allocator answered 404 to the route at `now_ms`.
    pub fn note_missing(&self, now_ms: u64) {
        self.until_ms.store(
            now_ms.saturating_add(MISSING_ROUTE_RETRY_MS),
            Ordering::Relaxed,
        );
    }
}

/// Why an allocator call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ClientError {
    /// No allocator answered (connection refused, timeout, or only followers without a leader).
    #[error("allocator unreachable: {0}")]
    Unreachable(String),
    /// An allocator answered with an error.
    #[error("allocator answered {status}: {detail}")]
    Refused {
        /// The HTTP status.
        status: u16,
        /// The problem's detail.
        detail: String,
    },
}

impl ClientError {
    /// Whether the allocator could not be reached (the partition case, where fallback applies).
    pub fn is_unreachable(&self) -> bool {
        matches!(self, ClientError::Unreachable(_))
            || matches!(self, ClientError::Refused { status, .. } if *status >= 500)
    }
}

#[derive(Debug, Deserialize)]
struct ProblemBody {
    #[serde(default)]
    detail: String,
    #[serde(default)]
    leader: Option<String>,
}

/// The client.
#[derive(Debug)]
pub struct AllocatorClient {
    urls: Vec<String>,
    token: String,
    http: reqwest::Client,
    preferred: AtomicUsize,
    shard_routes: Mutex<ShardRoutes>,
}

/// Reads an answer's body, refusing one longer than `limit` bytes without buffering the rest.
async fn read_capped(
    mut response: reqwest::Response,
    limit: usize,
) -> Result<Vec<u8>, ClientError> {
    let status = response.status().as_u16();
    let too_long = || ClientError::Refused {
        status,
        detail: format!("answer longer than {limit} bytes"),
    };
    if response
        .content_length()
        .is_some_and(|length| length > limit as u64)
    {
        return Err(too_long());
    }
    let mut body = Vec::new();
    while let Some(chunk) = response
        .chunk()
        .await
        .map_err(|e| ClientError::Unreachable(e.to_string()))?
    {
        if body.len() + chunk.len() > limit {
            return Err(too_long());
        }
        body.extend_from_slice(&chunk);
    }
    Ok(body)
}

impl AllocatorClient {
    /// A client of the allocators at `urls` (at least one), authenticating with the agent `token`.
    pub fn new(urls: Vec<String>, token: String) -> Result<Self, ClientError> {
        Self::with_tls(urls, token, &allot_net::ClientTls::default())
    }

    /// A client that reaches https:// allocators with `tls` (trusted CAs, client certificate).
    pub fn with_tls(
        urls: Vec<String>,
        token: String,
        tls: &allot_net::ClientTls,
    ) -> Result<Self, ClientError> {
        if urls.is_empty() {
            return Err(ClientError::Unreachable(
                "no allocator URL configured".to_owned(),
            ));
        }
        let builder = reqwest::Client::builder()
            .timeout(CALL_TIMEOUT)
            .connect_timeout(CALL_TIMEOUT);
        let http = tls
            .configure(builder)
            .map_err(|e| ClientError::Unreachable(e.to_string()))?
            .build()
            .map_err(|e| ClientError::Unreachable(e.to_string()))?;
        Ok(Self {
            urls: urls
                .into_iter()
                .map(|u| u.trim_end_matches('/').to_owned())
                .collect(),
            token,
            http,
            preferred: AtomicUsize::new(0),
            shard_routes: Mutex::default(),
        })
    }

    /// One call to the allocators, trying each from the last that answered, and following a "not
    /// the leader" answer to the leader it names: the answer read as `T`, `None` for an empty body
    /// or a 404, `Err` for a refusal or when none answers.
    async fn call<T: DeserializeOwned>(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<Option<T>, ClientError> {
        self.call_via(None, method, path, body).await
    }

    /// [`AllocatorClient::call`], trying `first` (a shard's leader) before the listed URLs.
    ///
    /// Long by design: one loop carries the whole failover: the next allocator to try, a redirect
    /// to the named leader taken before it, and the last error kept for the answer when all fail;
    /// split, that state would be passed in and out of each attempt, and which answers move on and
    /// which end the call would be read in several places.
    async fn call_via<T: DeserializeOwned>(
        &self,
        first: Option<&str>,
        method: reqwest::Method,
        path: &str,
        body: Option<&serde_json::Value>,
    ) -> Result<Option<T>, ClientError> {
        let start = self.preferred.load(Ordering::Relaxed);
        let mut last_error = String::from("no allocator tried");
        let mut redirect: Option<String> = first.map(|url| url.trim_end_matches('/').to_owned());
        let mut listed_tried = 0;
        // Every listed URL once, and a redirect before each (at most one is followed per answer).
        for _ in 0..=2 * self.urls.len() + 1 {
            let (index, base) = match redirect.take() {
                Some(leader) => (self.urls.iter().position(|u| *u == leader), leader),
                None => {
                    if listed_tried == self.urls.len() {
                        break;
                    }
                    let index = (start + listed_tried) % self.urls.len();
                    listed_tried += 1;
                    (Some(index), self.urls[index].clone())
                }
            };
            let mut request = self
                .http
                .request(method.clone(), format!("{base}{path}"))
                .bearer_auth(&self.token);
            if let Some(body) = body {
                request = request.json(body);
            }
            let response = match request.send().await {
                Ok(response) => response,
                Err(error) => {
                    last_error = format!("{base}: {error}");
                    continue;
                }
            };
            let status = response.status();
            if status.is_success() {
                if let Some(index) = index {
                    self.preferred.store(index, Ordering::Relaxed);
                }
                let body = read_capped(response, MAX_ANSWER_BYTES).await?;
                if body.iter().all(u8::is_ascii_whitespace) {
                    return Ok(None);
                }
                return serde_json::from_slice(&body)
                    .map(Some)
                    .map_err(|e| ClientError::Refused {
                        status: status.as_u16(),
                        detail: format!("unreadable answer: {e}"),
                    });
            }
            let problem: ProblemBody = match read_capped(response, MAX_ANSWER_BYTES).await {
                Ok(body) => serde_json::from_slice(&body).ok(),
                Err(_) => None,
            }
            .unwrap_or(ProblemBody {
                detail: String::new(),
                leader: None,
            });
            if status == reqwest::StatusCode::NOT_FOUND {
                return Ok(None);
            }
            if status == reqwest::StatusCode::SERVICE_UNAVAILABLE
                && let Some(leader) = problem.leader
            {
                last_error = format!("{base}: not the leader");
                redirect = Some(leader.trim_end_matches('/').to_owned());
                continue;
            }
            if status.is_server_error() {
                last_error = format!("{base}: {} {}", status.as_u16(), problem.detail);
                continue;
            }
            return Err(ClientError::Refused {
                status: status.as_u16(),
                detail: problem.detail,
            });
        }
        Err(ClientError::Unreachable(last_error))
    }

    /// A pool's terms, or `None` when the pool does not exist; asked by an agent (its region and
    /// id), also what that agent has reported admitting in fallback in the current window.
    pub async fn pool_terms(
        &self,
        tenant: &TenantId,
        pool: &PoolId,
        asker: Option<(&RegionId, &AgentId)>,
    ) -> Result<Option<PoolTerms>, ClientError> {
        let query = asker.map_or(String::new(), |(region, agent)| {
            format!("?region={region}&agentId={agent}")
        });
        self.call(
            reqwest::Method::GET,
            &format!("/v1/pools/{tenant}/{pool}/terms{query}"),
            None,
        )
        .await
    }

    /// `POST /v1/terms/batch`: several pools' terms in one call. One answer per pool, in order,
    /// as [`AllocatorClient::pool_terms`] would have given it: the terms, `None` when the pool
    /// does not exist, or the error. An allocator without the route answers 404 (`Err` for the
    /// whole call).
    pub async fn pool_terms_batch(
        &self,
        batch: &TermsBatch,
    ) -> Result<Vec<TermsOutcome>, ClientError> {
        let answer: Option<TermsBatchAnswer> = self
            .call(
                reqwest::Method::POST,
                "/v1/terms/batch",
                Some(&to_json(batch)?),
            )
            .await?;
        let results = one_per_entry(
            "/v1/terms/batch",
            answer.map(|answer| answer.results),
            batch.pools.len(),
        )?;
        Ok(results.into_iter().map(terms_outcome).collect())
    }

    /// Asks for a grant; `None` when the pool does not exist.
    pub async fn grant(
        &self,
        tenant: &TenantId,
        pool: &PoolId,
        region: &RegionId,
        lease_id: LeaseId,
        want: u64,
    ) -> Result<Option<GrantAnswer>, ClientError> {
        let body = GrantBody {
            lease_id,
            tenant: tenant.clone(),
            pool: pool.clone(),
            region: region.clone(),
            want_tokens: want,
        };
        let leader = self.shard_leader(tenant, pool).await;
        self.call_via(
            leader.as_deref(),
            reqwest::Method::POST,
            "/v1/grants",
            Some(&to_json(&body)?),
        )
        .await
    }

    /// `POST /v1/grants/batch`: several pools' renewals in one call, each idempotent by its lease
    /// id. One answer per ask, in order, as [`AllocatorClient::grant`] would have given it: the
    /// grant, `None` when the pool does not exist, or the error. An allocator without the route
    /// answers 404 (`Err` for the whole call).
    /// Split into shards, the asks go in one call per shard leader, all at once.
    pub async fn grant_batch(&self, batch: &GrantBatch) -> Result<Vec<GrantOutcome>, ClientError> {
        let results = self
            .routed_batch(
                "/v1/grants/batch",
                &batch.grants,
                |ask| (&ask.tenant, &ask.pool),
                |grants| GrantBatch { grants },
                |answer: GrantBatchAnswer| answer.results,
            )
            .await?;
        if results
            .iter()
            .any(|result| result.problem.as_ref().is_some_and(|p| p.status == 503))
        {
            self.lock_routes().stale = true;
        }
        Ok(results.into_iter().map(grant_outcome).collect())
    }

    /// Starts this run's session (idempotent for one incarnation): how the agent's previous run
    /// ended. `None` from an allocator that keeps no sessions (older than the agent).
    pub async fn start_session(
        &self,
        session: &AgentSession,
    ) -> Result<Option<AgentSessionStarted>, ClientError> {
        self.call(
            reqwest::Method::POST,
            "/v1/agent-sessions",
            Some(&to_json(session)?),
        )
        .await
    }

    /// Ends this run's session: every fallback admit is reported. Whether it is recorded ended.
    pub async fn end_session(&self, session: &AgentSession) -> Result<bool, ClientError> {
        let ended: Option<AgentSessionEnded> = self
            .call(
                reqwest::Method::POST,
                "/v1/agent-sessions/end",
                Some(&to_json(session)?),
            )
            .await?;
        Ok(ended.is_some_and(|e| e.ended))
    }

    /// Sends a report (idempotent by its id): its receipt (none from an allocator that answers
    /// without a body).
    pub async fn report(&self, report: &Report) -> Result<Option<ReportReceipt>, ClientError> {
        let leader = self.shard_leader(&report.tenant, &report.pool).await;
        self.call_via::<ReportReceipt>(
            leader.as_deref(),
            reqwest::Method::POST,
            "/v1/reports",
            Some(&to_json(report)?),
        )
        .await
    }

    /// `POST /v1/reports/batch`: a round's reports in one call, each taken once per report id; one
    /// result per report, in order. An allocator without the route answers 404. Split into
    /// shards, one call per shard leader (whose give-backs only it can take back), all at once.
    pub async fn report_batch(
        &self,
        batch: &ReportBatch,
    ) -> Result<Vec<ReportResult>, ClientError> {
        self.routed_batch(
            "/v1/reports/batch",
            &batch.reports,
            |report| (&report.tenant, &report.pool),
            |reports| ReportBatch { reports },
            |answer: ReportBatchAnswer| answer.results,
        )
        .await
    }

    /// `entries` of the batch route at `path`, sent as one call per shard leader (one call when
    /// the pools are not split), all at once: one result per entry, in their order. `pool_of`
    /// names an entry's pool, `body` makes a call's body of its entries, `results` reads its
    /// answer's results.
    async fn routed_batch<E: Clone, B: Serialize, A: DeserializeOwned, R>(
        &self,
        path: &str,
        entries: &[E],
        pool_of: impl Fn(&E) -> (&TenantId, &PoolId),
        body: impl Fn(Vec<E>) -> B,
        results: impl Fn(A) -> Vec<R>,
    ) -> Result<Vec<R>, ClientError> {
        let routes = self.shard_routes().await;
        let groups = by_leader(routes.as_ref(), entries.iter().map(&pool_of));
        let calls = groups.iter().map(|(leader, indices)| {
            let part = body(indices.iter().map(|&i| entries[i].clone()).collect());
            let (results, sent) = (&results, indices.len());
            async move {
                let answer: Option<A> = self
                    .call_via(
                        leader.as_deref(),
                        reqwest::Method::POST,
                        path,
                        Some(&to_json(&part)?),
                    )
                    .await?;
                one_per_entry(path, answer.map(results), sent)
            }
        });
        let answers = futures::future::join_all(calls).await;
        in_order(&groups, answers, entries.len())
    }

    fn lock_routes(&self) -> std::sync::MutexGuard<'_, ShardRoutes> {
        self.shard_routes
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Each shard's leader URL while the allocators split the pools into shards (`None` with one
    /// shard, or from allocators without shards). The map is read again every
    /// [`SHARD_MAP_REUSED_MS`], and at once after an allocator refused an entry as not its
    /// shard's leader; a failed read keeps the last map (calls still follow redirects).
    async fn shard_routes(&self) -> Option<(ShardCount, Vec<Option<String>>)> {
        let due = {
            let routes = self.lock_routes();
            routes.stale
                || routes
                    .read_at
                    .is_none_or(|at| at.elapsed() >= Duration::from_millis(SHARD_MAP_REUSED_MS))
        };
        if due {
            let read = self
                .call::<ShardMap>(reqwest::Method::GET, "/v1/shards", None)
                .await;
            let mut routes = self.lock_routes();
            routes.read_at = Some(crate::clock::monotonic_now());
            routes.stale = false;
            match read {
                Ok(map) => routes.leaders = map.and_then(leader_urls),
                Err(error) => tracing::debug!(%error, "shard map not read; the last one stands"),
            }
        }
        self.lock_routes()
            .leaders
            .clone()
            .filter(|(count, _)| count.get() > 1)
    }

    /// The URL of the leader of `tenant/pool`'s shard, when the pools are split and it is known.
    async fn shard_leader(&self, tenant: &TenantId, pool: &PoolId) -> Option<String> {
        let (count, leaders) = self.shard_routes().await?;
        leaders
            .get(shard_of(tenant, pool, count).0 as usize)
            .cloned()
            .flatten()
    }

    /// The bundle this region should run, verified; `None` when nothing is published.
    pub async fn current_policy(
        &self,
        region: &RegionId,
    ) -> Result<Option<PolicyBundle>, ClientError> {
        let value: Option<serde_json::Value> = self
            .call(
                reqwest::Method::GET,
                &format!("/v1/policies/current?region={region}"),
                None,
            )
            .await?;
        let Some(value) = value else {
            return Ok(None);
        };
        parse_bundle(&value.to_string())
            .and_then(|draft| draft.into_verified())
            .map(Some)
            .map_err(|e| ClientError::Refused {
                status: 200,
                detail: format!("the published bundle does not verify: {e}"),
            })
    }

    /// The rule overrides in force, verified, when their version is above `held` (the version
    /// this agent holds); `None` when it holds the latest.
    pub async fn overrides(&self, held: u64) -> Result<Option<OverrideSet>, ClientError> {
        let set: Option<OverrideSet> = self
            .call(
                reqwest::Method::GET,
                &format!("/v1/overrides/current?after={held}"),
                None,
            )
            .await?;
        set.map(OverrideSet::verify)
            .transpose()
            .map_err(|e| ClientError::Refused {
                status: 200,
                detail: format!("the override set does not verify: {e}"),
            })
    }

    /// Tells the allocator which bundle version this agent runs.
    pub async fn report_status(
        &self,
        region: &RegionId,
        agent_id: &AgentId,
        version: u64,
        pepper_fingerprint: &str,
    ) -> Result<(), ClientError> {
        let status = AgentStatus {
            region: region.clone(),
            agent_id: agent_id.clone(),
            version,
            reported_at_ms: 0,
            pepper_fingerprint: Some(pepper_fingerprint.to_owned()),
        };
        self.call::<serde_json::Value>(
            reqwest::Method::POST,
            "/v1/policies/status",
            Some(&to_json(&status)?),
        )
        .await
        .map(|_| ())
    }
}

/// Each shard's leader URL from a shard map (`None` for a map that is not one).
fn leader_urls(map: ShardMap) -> Option<(ShardCount, Vec<Option<String>>)> {
    let count = ShardCount::new(map.shard_count).ok()?;
    let mut leaders = vec![None; count.get() as usize];
    for lead in map.shards {
        if let Some(slot) = leaders.get_mut(lead.shard.0 as usize) {
            *slot = lead
                .leader
                .map(|leader| leader.url.trim_end_matches('/').to_owned());
        }
    }
    Some((count, leaders))
}

/// A batch's entries (by their pools) grouped by where they go first: their shard's leader, or
/// (`None`) wherever calls go without shards. One group when the pools are not split.
fn by_leader<'a>(
    routes: Option<&(ShardCount, Vec<Option<String>>)>,
    pools: impl Iterator<Item = (&'a TenantId, &'a PoolId)>,
) -> Vec<(Option<String>, Vec<usize>)> {
    let mut groups: BTreeMap<Option<String>, Vec<usize>> = BTreeMap::new();
    for (index, (tenant, pool)) in pools.enumerate() {
        let leader = routes.and_then(|(count, leaders)| {
            leaders
                .get(shard_of(tenant, pool, *count).0 as usize)
                .cloned()
                .flatten()
        });
        groups.entry(leader).or_default().push(index);
    }
    if groups.is_empty() {
        groups.insert(None, Vec::new());
    }
    groups.into_iter().collect()
}

/// The results of a batch sent as `groups`, back in the order of its `sent` entries: `Err` when
/// any group's call failed whole (every entry is idempotent, so the caller sends the whole batch
/// again).
fn in_order<R>(
    groups: &[(Option<String>, Vec<usize>)],
    answers: Vec<Result<Vec<R>, ClientError>>,
    sent: usize,
) -> Result<Vec<R>, ClientError> {
    let mut placed: Vec<Option<R>> = (0..sent).map(|_| None).collect();
    for ((_, indices), answer) in groups.iter().zip(answers) {
        for (&index, result) in indices.iter().zip(answer?) {
            placed[index] = Some(result);
        }
    }
    placed
        .into_iter()
        .map(|result| {
            result.ok_or_else(|| ClientError::Refused {
                status: 200,
                detail: "a batch entry without a result".to_owned(),
            })
        })
        .collect()
}

/// A batch route's results, one per entry sent (`sent`): `None` is the 404 of an allocator without
/// the route (`call` reads a 404 as nothing), and a count that does not match is a refusal.
fn one_per_entry<R>(
    path: &str,
    results: Option<Vec<R>>,
    sent: usize,
) -> Result<Vec<R>, ClientError> {
    match results {
        Some(results) if results.len() == sent => Ok(results),
        Some(results) => Err(ClientError::Refused {
            status: 200,
            detail: format!("{} results for {sent} entries from {path}", results.len()),
        }),
        None => Err(ClientError::Refused {
            status: 404,
            detail: format!("no POST {path} at this allocator"),
        }),
    }
}

/// What one grant call, or one ask of a batch, came to: the grant, `None` when the pool does not
/// exist, or why not.
pub type GrantOutcome = Result<Option<GrantAnswer>, ClientError>;

/// One ask's result in a batch as [`AllocatorClient::grant`] gives it alone. A result with neither
/// a grant nor a problem is read as no answer: the ask may have been granted.
fn grant_outcome(result: GrantResult) -> GrantOutcome {
    match (result.grant, result.problem) {
        (Some(grant), _) => Ok(Some(grant)),
        (None, Some(problem)) if problem.status == 404 => Ok(None),
        (None, Some(problem)) => Err(ClientError::Refused {
            status: problem.status,
            detail: problem.detail,
        }),
        (None, None) => Err(ClientError::Unreachable(
            "a batch result with neither a grant nor a problem".to_owned(),
        )),
    }
}

/// What one terms call, or one pool of a batch, came to: the terms, `None` when the pool does
/// not exist, or why not.
pub type TermsOutcome = Result<Option<PoolTerms>, ClientError>;

/// One pool's result in a terms batch as [`AllocatorClient::pool_terms`] gives it alone.
fn terms_outcome(result: TermsResult) -> TermsOutcome {
    match (result.terms, result.problem) {
        (Some(terms), _) => Ok(Some(terms)),
        (None, Some(problem)) if problem.status == 404 => Ok(None),
        (None, Some(problem)) => Err(ClientError::Refused {
            status: problem.status,
            detail: problem.detail,
        }),
        (None, None) => Err(ClientError::Refused {
            status: 200,
            detail: "a batch result with neither terms nor a problem".to_owned(),
        }),
    }
}

fn to_json<T: Serialize>(message: &T) -> Result<serde_json::Value, ClientError> {
    serde_json::to_value(message).map_err(|e| ClientError::Refused {
        status: 0,
        detail: e.to_string(),
    })
}

//! Pool configuration and the records the allocator keeps in its store.
//!
//! Layout (all values JSON):
//! - `/allot/pools/<tenant>/<pool>`: the pool's configuration and its version;
//! - `/allot/windows/<tenant>/<pool>`: the current window's grants per region;
//! - `/allot/grants/<tenant>/<pool>/<leaseId>`: every grant, attached to a store lease that outlives
//!   the window by at least one window length (bounded retention; a retry older than that is moot).

use std::collections::BTreeMap;

use allot_shared::ids::{Epoch, LeaseId, PoolId, RegionId, TenantId};
use allot_shared::lease::{Grant, PoolConfig, PoolConfigError, PoolWindowState};
use allot_shared::overrides::PoolOverride;
use allot_shared::window::Window;
use allot_shared::wire::{CalendarWindowSpec, GrantAnswer};
use serde::{Deserialize, Serialize};

use crate::kv::{Compare, Kv, KvError, MAX_PREFIX_KEYS, MAX_TXN_OPS, Op, Versioned};

/// Where pool configurations live in the store.
const POOLS_PREFIX: &str = "/allot/pools/";

/// Key of a pool's configuration.
pub fn pool_key(tenant: &TenantId, pool: &PoolId) -> String {
    format!("{POOLS_PREFIX}{tenant}/{pool}")
}

/// Key of a pool's current window.
pub fn window_key(tenant: &TenantId, pool: &PoolId) -> String {
    format!("/allot/windows/{tenant}/{pool}")
}

/// Where grant records live in the store.
const GRANTS_PREFIX: &str = "/allot/grants/";

/// Prefix of a pool's grant records.
pub fn grant_prefix(tenant: &TenantId, pool: &PoolId) -> String {
    format!("{GRANTS_PREFIX}{tenant}/{pool}/")
}

/// Key of one grant record.
pub fn grant_key(tenant: &TenantId, pool: &PoolId, lease: &LeaseId) -> String {
    format!("{}{lease}", grant_prefix(tenant, pool))
}

/// Where the marks of leases whose unspent tokens were given back live in the store.
const RETURNS_PREFIX: &str = "/allot/returns/";

/// Key of the mark that a lease's unspent tokens were given back (its value: how many): written
/// once, guarded by its absence, so a lease's tokens are taken back at most once.
pub fn return_key(tenant: &TenantId, pool: &PoolId, lease: &LeaseId) -> String {
    format!("{RETURNS_PREFIX}{tenant}/{pool}/{lease}")
}

/// What a lease's give-back mark says was taken back (`None`: no mark).
pub async fn get_return(
    kv: &dyn Kv,
    tenant: &TenantId,
    pool: &PoolId,
    lease: &LeaseId,
) -> Result<Option<u64>, PoolStoreError> {
    let key = return_key(tenant, pool, lease);
    match kv.get(&key).await? {
        Some(stored) => decode(&key, &stored.value).map(Some),
        None => Ok(None),
    }
}

/// A pool's configuration as operators write it (`PUT /v1/pools/{tenant}/{pool}`), and as it is
/// stored. One of three types of a pool's terms, each for its own boundary: this is the operator's
/// document (unknown fields refused, `windowMs` or `window`, defaults for what may be left out),
/// kept as written; [`PoolConfig`] is the validated value every decision uses (its invariants held
/// by construction, [`PoolSpec::validate`] the one way in); [`PoolTerms`](allot_shared::wire::PoolTerms)
/// is what agents are told (the same terms plus the version and a region's fallback so far, read
/// tolerantly by agents of other versions).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct PoolSpec {
    /// `G`: tokens per window.
    #[serde(rename = "limit")]
    pub limit_tokens: u64,
    /// Window length, ms (0 or absent when `window` gives calendar windows).
    #[serde(default, skip_serializing_if = "allot_shared::wire::is_zero")]
    pub window_ms: u64,
    /// Calendar windows instead of `windowMs`: `{"calendar": "month", "timeZone": "Europe/Berlin"}`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub window: Option<CalendarWindowSpec>,
    /// Largest grant, tokens.
    #[serde(rename = "chunk")]
    pub chunk_tokens: u64,
    /// Lease TTL before clamping, ms.
    pub lease_ttl_ms: u64,
    /// Tokens each region may admit per window while the allocator is unreachable.
    #[serde(rename = "fallbackPerRegion")]
    pub fallback_per_region_tokens: u64,
    /// Debt each region may carry per window from metered requests settled above their estimate,
    /// tokens (default 0): a term of the overshoot bound.
    #[serde(
        default,
        rename = "settleDebtPerRegion",
        skip_serializing_if = "allot_shared::wire::is_zero"
    )]
    pub settle_debt_per_region_tokens: u64,
    /// Regions allowed to take grants.
    pub regions: Vec<RegionId>,
}

impl PoolSpec {
    /// Validates into the core's [`PoolConfig`]: exactly one of `windowMs` and `window`.
    pub fn validate(&self) -> Result<PoolConfig, PoolConfigError> {
        let Some(calendar) = &self.window else {
            return PoolConfig::new(
                self.limit_tokens,
                self.window_ms,
                self.chunk_tokens,
                self.lease_ttl_ms,
                self.fallback_per_region_tokens,
                self.regions.clone(),
            )?
            .with_settle_debt_per_region(self.settle_debt_per_region_tokens);
        };
        if self.window_ms != 0 {
            return Err(PoolConfigError::new(
                "windowMs",
                "give either windowMs or window (calendar windows), not both",
            ));
        }
        PoolConfig::with_window(
            self.limit_tokens,
            calendar.to_spec()?,
            self.chunk_tokens,
            self.lease_ttl_ms,
            self.fallback_per_region_tokens,
            self.regions.clone(),
        )?
        .with_settle_debt_per_region(self.settle_debt_per_region_tokens)
    }

    /// The windows in words: `60000 ms`, or `month in Europe/Berlin`.
    pub fn window_text(&self) -> String {
        match &self.window {
            Some(calendar) => format!("{} in {}", calendar.calendar, calendar.time_zone),
            None => format!("{} ms", self.window_ms),
        }
    }
}

/// A stored pool: its spec, version and last update.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredPool {
    /// The configuration.
    pub spec: PoolSpec,
    /// Starts at 1, +1 per update.
    pub version: u64,
    /// When it was last written, epoch ms (allocator clock).
    pub updated_at_ms: u64,
    /// Its limit's overrides: the one in force, if any, and ended ones kept for the accounting of
    /// the windows they touched (`crate::overrides`; at most
    /// [`MAX_POOL_OVERRIDES_KEPT`](allot_shared::overrides::MAX_POOL_OVERRIDES_KEPT)).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub overrides: Vec<PoolOverride>,
}

impl StoredPool {
    /// Its `G` at `now_ms`: the override's in force, else the spec's.
    pub fn limit_at(&self, now_ms: u64) -> u64 {
        allot_shared::overrides::limit_at(self.spec.limit_tokens, &self.overrides, now_ms)
    }

    /// Its terms as agents are given them at `now_ms` (`GET .../terms`), with what the asking
    /// agent has admitted in fallback in the current window when it asked as one.
    pub fn terms(
        &self,
        now_ms: u64,
        fallback_in_window: Option<allot_shared::wire::FallbackInWindow>,
    ) -> allot_shared::wire::PoolTerms {
        let spec = &self.spec;
        allot_shared::wire::PoolTerms {
            limit_tokens: spec.limit_tokens,
            // Old agents read windowMs alone: for calendar windows it is the longest one.
            window_ms: spec
                .validate()
                .map_or(spec.window_ms, |c| c.window().longest_ms()),
            window: spec.window.clone(),
            chunk_tokens: spec.chunk_tokens,
            lease_ttl_ms: spec.lease_ttl_ms,
            fallback_per_region_tokens: spec.fallback_per_region_tokens,
            settle_debt_per_region_tokens: spec.settle_debt_per_region_tokens,
            regions: spec.regions.clone(),
            version: self.version,
            fallback_in_window,
            limit_override: self
                .overrides
                .iter()
                .find(|o| o.in_force_at(now_ms))
                .cloned(),
        }
    }
}

/// The stored form of a window's accounting.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredWindow {
    /// Window start, epoch ms.
    pub window_start_ms: u64,
    /// Window end, epoch ms.
    pub window_end_ms: u64,
    /// Tokens granted per region.
    pub granted_by_region: BTreeMap<RegionId, u64>,
    /// Tokens leases gave back in the window (absent: none, as in windows stored before).
    #[serde(default, skip_serializing_if = "allot_shared::wire::is_zero")]
    pub returned_tokens: u64,
}

impl From<&PoolWindowState> for StoredWindow {
    fn from(state: &PoolWindowState) -> Self {
        Self {
            window_start_ms: state.window.start_ms,
            window_end_ms: state.window.end_ms,
            granted_by_region: state.granted_by_region.clone(),
            returned_tokens: state.returned_tokens,
        }
    }
}

impl From<StoredWindow> for PoolWindowState {
    fn from(stored: StoredWindow) -> Self {
        Self {
            window: Window {
                start_ms: stored.window_start_ms,
                end_ms: stored.window_end_ms,
            },
            granted_by_region: stored.granted_by_region,
            returned_tokens: stored.returned_tokens,
        }
    }
}

/// A grant as stored (the answer to an agent is [`GrantRecord::answer`]).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GrantRecord {
    /// The request's lease id.
    pub lease_id: LeaseId,
    /// The region it was granted to.
    pub region: RegionId,
    /// Tokens granted.
    #[serde(rename = "granted")]
    pub granted_tokens: u64,
    /// The granting leader's epoch.
    pub epoch: Epoch,
    /// Window start, epoch ms.
    pub window_start_ms: u64,
    /// Window end, epoch ms.
    pub window_end_ms: u64,
    /// No token may be spent at or after this instant, epoch ms.
    pub expires_at_ms: u64,
    /// When nothing was granted, ms until the next window; else 0.
    pub retry_after_ms: u64,
    /// When it was granted (this allocator's clock), epoch ms; 0 in records stored before the
    /// field existed. `expiresAtMs - issuedAtMs` is how long the lease lasts: agents measure that
    /// on their own monotonic clock, so their wall clocks need not agree with the allocator's.
    #[serde(default)]
    pub issued_at_ms: u64,
    /// What the window had left to grant after this grant, tokens; absent in records stored before
    /// the field existed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ungranted_tokens: Option<u64>,
}

impl GrantRecord {
    /// The answer to an agent (`POST /v1/grants`) made from this record at `answered_at_ms` (this
    /// allocator's clock): later than the issue for a lease id asked again after a lost answer.
    /// The terms' version is the grant service's to add (a record does not keep it).
    pub fn answer(&self, answered_at_ms: u64) -> GrantAnswer {
        GrantAnswer {
            lease_id: self.lease_id,
            region: self.region.clone(),
            granted_tokens: self.granted_tokens,
            epoch: self.epoch,
            window_start_ms: self.window_start_ms,
            window_end_ms: self.window_end_ms,
            expires_at_ms: self.expires_at_ms,
            retry_after_ms: self.retry_after_ms,
            issued_at_ms: self.issued_at_ms,
            answered_at_ms: answered_at_ms.max(self.issued_at_ms),
            ungranted_tokens: self.ungranted_tokens,
            returnable: self.granted_tokens > 0,
            terms_version: 0,
        }
    }
}

impl From<&Grant> for GrantRecord {
    fn from(grant: &Grant) -> Self {
        Self {
            lease_id: grant.lease_id,
            region: grant.region.clone(),
            granted_tokens: grant.granted_tokens,
            epoch: grant.epoch,
            window_start_ms: grant.window.start_ms,
            window_end_ms: grant.window.end_ms,
            expires_at_ms: grant.expires_at_ms,
            retry_after_ms: grant.retry_after_ms,
            issued_at_ms: grant.issued_at_ms,
            ungranted_tokens: Some(grant.ungranted_tokens),
        }
    }
}

/// Failure of a pool operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PoolStoreError {
    /// The spec is invalid.
    #[error("{0}")]
    Invalid(#[from] PoolConfigError),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] KvError),
    /// The stored value could not be decoded (a bug or a foreign writer).
    #[error("stored value at {0} is not readable")]
    Corrupt(String),
    /// Concurrent writers kept winning.
    #[error("the pool changed concurrently too often; retry")]
    Contended,
}

fn decode<T: for<'de> Deserialize<'de>>(key: &str, bytes: &[u8]) -> Result<T, PoolStoreError> {
    serde_json::from_slice(bytes).map_err(|_| PoolStoreError::Corrupt(key.to_owned()))
}

fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // Serializing these plain records cannot fail.
    serde_json::to_vec(value).unwrap_or_default()
}

/// A pool's configuration as stored at `key`, and the revision of the key.
fn stored_pool(key: &str, value: &Versioned) -> Result<(StoredPool, i64), PoolStoreError> {
    Ok((decode(key, &value.value)?, value.mod_revision))
}

/// A pool's window as stored at `key`, and the revision of the key.
fn stored_window(key: &str, value: &Versioned) -> Result<(PoolWindowState, i64), PoolStoreError> {
    let stored: StoredWindow = decode(key, &value.value)?;
    Ok((stored.into(), value.mod_revision))
}

/// The tenant and pool a store key under `prefix` names: `<prefix><tenant>/<pool>`, and with
/// `more` (a pool's grant record) a further `/<lease>`.
fn pool_of_key(key: &str, prefix: &str, more: bool) -> Result<(TenantId, PoolId), PoolStoreError> {
    let corrupt = || PoolStoreError::Corrupt(key.to_owned());
    let mut parts = key
        .strip_prefix(prefix)
        .ok_or_else(corrupt)?
        .splitn(if more { 3 } else { 2 }, '/');
    let (Some(tenant), Some(pool)) = (parts.next(), parts.next()) else {
        return Err(corrupt());
    };
    if more && parts.next().is_none() {
        return Err(corrupt());
    }
    Ok((
        TenantId::parse(tenant).map_err(|_| corrupt())?,
        PoolId::parse(pool).map_err(|_| corrupt())?,
    ))
}

/// Reads a pool and the revision of its key.
pub async fn get_pool(
    kv: &dyn Kv,
    tenant: &TenantId,
    pool: &PoolId,
) -> Result<Option<(StoredPool, i64)>, PoolStoreError> {
    let key = pool_key(tenant, pool);
    kv.get(&key)
        .await?
        .map(|value| stored_pool(&key, &value))
        .transpose()
}

/// Creates or replaces a pool, bumping its version. Concurrent writers are serialised by the store.
pub async fn put_pool(
    kv: &dyn Kv,
    tenant: &TenantId,
    pool: &PoolId,
    spec: PoolSpec,
    now_ms: u64,
) -> Result<StoredPool, PoolStoreError> {
    spec.validate()?;
    let key = pool_key(tenant, pool);
    for _ in 0..8 {
        let existing = get_pool(kv, tenant, pool).await?;
        let (version, revision, overrides) = existing
            .map_or((1, 0, Vec::new()), |(stored, revision)| {
                (stored.version + 1, revision, stored.overrides)
            });
        let stored = StoredPool {
            spec: spec.clone(),
            version,
            updated_at_ms: now_ms,
            overrides,
        };
        let outcome = kv
            .txn(
                vec![Compare::ModRevision {
                    key: key.clone(),
                    revision,
                }],
                vec![Op::Put {
                    key: key.clone(),
                    value: encode(&stored),
                    lease: None,
                }],
            )
            .await?;
        if outcome.succeeded {
            return Ok(stored);
        }
    }
    Err(PoolStoreError::Contended)
}

/// What writing a pool in bulk did to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub enum BulkOutcome {
    /// It did not exist; it is at version 1.
    Created,
    /// Its spec differed; its version went up by one.
    Updated,
    /// Its spec was already this one: nothing was written, so a repeated bulk write is a no-op.
    Unchanged,
}

/// Creates or replaces many pools, each a store transaction of up to [`MAX_TXN_OPS`] pools
/// guarded by every written key's revision. A pool whose stored spec equals the given one is left
/// alone (its version too), so sending the same pools again changes nothing. Not atomic across
/// transactions: a failure part way leaves the earlier ones written, and the same call again
/// finishes the rest. Every spec is validated before anything is written.
pub async fn put_pools(
    kv: &dyn Kv,
    pools: &[(TenantId, PoolId, PoolSpec)],
    now_ms: u64,
) -> Result<Vec<(StoredPool, BulkOutcome)>, PoolStoreError> {
    for (_, _, spec) in pools {
        spec.validate()?;
    }
    let mut written = Vec::with_capacity(pools.len());
    for chunk in pools.chunks(MAX_TXN_OPS) {
        written.extend(put_pools_at_once(kv, chunk, now_ms).await?);
    }
    Ok(written)
}

/// One transaction of [`put_pools`], retried while concurrent writers win.
async fn put_pools_at_once(
    kv: &dyn Kv,
    pools: &[(TenantId, PoolId, PoolSpec)],
    now_ms: u64,
) -> Result<Vec<(StoredPool, BulkOutcome)>, PoolStoreError> {
    debug_assert!(pools.len() <= MAX_TXN_OPS, "one transaction's worth");
    for _ in 0..8 {
        let keys: Vec<String> = pools
            .iter()
            .map(|(tenant, pool, _)| pool_key(tenant, pool))
            .collect();
        let existing = kv
            .get_many(&keys)
            .await?
            .into_iter()
            .zip(&keys)
            .map(|(value, key)| value.map(|v| stored_pool(key, &v)).transpose())
            .collect::<Result<Vec<_>, PoolStoreError>>()?;
        let mut compares = Vec::new();
        let mut ops = Vec::new();
        let mut written = Vec::with_capacity(pools.len());
        for ((tenant, pool, spec), existing) in pools.iter().zip(existing) {
            let (version, revision, overrides, outcome) = match existing {
                Some((stored, _)) if stored.spec == *spec => {
                    written.push((stored, BulkOutcome::Unchanged));
                    continue;
                }
                Some((stored, revision)) => (
                    stored.version + 1,
                    revision,
                    stored.overrides,
                    BulkOutcome::Updated,
                ),
                None => (1, 0, Vec::new(), BulkOutcome::Created),
            };
            let stored = StoredPool {
                spec: spec.clone(),
                version,
                updated_at_ms: now_ms,
                overrides,
            };
            let key = pool_key(tenant, pool);
            compares.push(Compare::ModRevision {
                key: key.clone(),
                revision,
            });
            ops.push(Op::Put {
                key,
                value: encode(&stored),
                lease: None,
            });
            written.push((stored, outcome));
        }
        if ops.is_empty() || kv.txn(compares, ops).await?.succeeded {
            return Ok(written);
        }
    }
    Err(PoolStoreError::Contended)
}

/// Deletes a pool and its window record. Returns whether it existed. Outstanding leases stay valid
/// until they expire (no refunds, no revocations); new grants get 404.
pub async fn delete_pool(
    kv: &dyn Kv,
    tenant: &TenantId,
    pool: &PoolId,
) -> Result<bool, PoolStoreError> {
    let key = pool_key(tenant, pool);
    let existed = kv.get(&key).await?.is_some();
    kv.txn(
        vec![],
        vec![
            Op::Delete { key },
            Op::Delete {
                key: window_key(tenant, pool),
            },
        ],
    )
    .await?;
    Ok(existed)
}

/// Which pools a listing reaches: those whose `tenant/pool` starts with this text. A tenant
/// prefix (`acme`), a whole tenant (`acme/`), or a tenant and a pool prefix (`acme/api`); empty
/// reaches every pool. A prefix of a valid id is a valid id, so each part is checked as one.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolPrefix(String);

impl PoolPrefix {
    /// Every pool.
    pub fn all() -> Self {
        Self::default()
    }

    /// Parses `tenant-prefix`, `tenant/` or `tenant/pool-prefix` (empty: every pool).
    pub fn parse(text: &str) -> Result<Self, allot_shared::ids::IdError> {
        match text.split_once('/') {
            None if text.is_empty() => Ok(Self::all()),
            None => TenantId::parse(text).map(|_| Self(text.to_owned())),
            Some((tenant, pool)) => {
                TenantId::parse(tenant)?;
                if !pool.is_empty() {
                    PoolId::parse(pool)?;
                }
                Ok(Self(text.to_owned()))
            }
        }
    }

    /// The prefix as written.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    fn key_prefix(&self) -> String {
        format!("{POOLS_PREFIX}{}", self.0)
    }
}

/// Lists every pool.
pub async fn list_pools(
    kv: &dyn Kv,
) -> Result<Vec<(TenantId, PoolId, StoredPool)>, PoolStoreError> {
    list_pools_matching(kv, &PoolPrefix::all()).await
}

/// Lists every pool `prefix` reaches, in key order.
pub async fn list_pools_matching(
    kv: &dyn Kv,
    prefix: &PoolPrefix,
) -> Result<Vec<(TenantId, PoolId, StoredPool)>, PoolStoreError> {
    let mut pools = Vec::new();
    let mut after: Option<(TenantId, PoolId)> = None;
    // Page by page: no listing is cut short at one read's cap, however many pools there are.
    loop {
        let page = list_pools_page(kv, prefix, after.as_ref(), MAX_PREFIX_KEYS).await?;
        let full = page.len() >= MAX_PREFIX_KEYS;
        after = page
            .last()
            .map(|(tenant, pool, _)| (tenant.clone(), pool.clone()));
        pools.extend(page);
        if !full {
            return Ok(pools);
        }
    }
}

/// Up to `limit` pools that `prefix` reaches, in key order, after `after` (from the first when
/// `None`): one page, costing its own size whatever the number of pools.
pub async fn list_pools_page(
    kv: &dyn Kv,
    prefix: &PoolPrefix,
    after: Option<&(TenantId, PoolId)>,
    limit: usize,
) -> Result<Vec<(TenantId, PoolId, StoredPool)>, PoolStoreError> {
    let after_key = after.map_or_else(String::new, |(tenant, pool)| pool_key(tenant, pool));
    let mut pools = Vec::new();
    for (key, value) in kv
        .get_prefix_after(&prefix.key_prefix(), &after_key, limit)
        .await?
    {
        let (tenant, pool) = pool_of_key(&key, POOLS_PREFIX, false)?;
        pools.push((tenant, pool, decode(&key, &value.value)?));
    }
    Ok(pools)
}

/// Reads a pool's current window record.
pub async fn get_window(
    kv: &dyn Kv,
    tenant: &TenantId,
    pool: &PoolId,
) -> Result<Option<(PoolWindowState, i64)>, PoolStoreError> {
    let key = window_key(tenant, pool);
    kv.get(&key)
        .await?
        .map(|value| stored_window(&key, &value))
        .transpose()
}

/// A pool's configuration and current window as one read found them, with their keys' revisions
/// (`None`: the key is absent).
pub type PoolAndWindow = (Option<(StoredPool, i64)>, Option<(PoolWindowState, i64)>);

/// Reads `pools`' records, at [`MAX_TXN_OPS`] keys a round trip, each
/// answer at its pool's place: `None` where no such pool exists, an error where its record does
/// not decode.
pub async fn get_pools(
    kv: &dyn Kv,
    pools: &[(TenantId, PoolId)],
) -> Result<Vec<Result<Option<StoredPool>, PoolStoreError>>, PoolStoreError> {
    let mut read = Vec::with_capacity(pools.len());
    for chunk in pools.chunks(crate::kv::MAX_TXN_OPS) {
        let keys: Vec<String> = chunk
            .iter()
            .map(|(tenant, pool)| pool_key(tenant, pool))
            .collect();
        let values = kv.get_many(&keys).await?;
        read.extend(keys.iter().zip(values).map(|(key, value)| {
            value
                .map(|value| stored_pool(key, &value).map(|(stored, _)| stored))
                .transpose()
        }));
    }
    debug_assert_eq!(read.len(), pools.len(), "one answer per pool");
    Ok(read)
}

/// Reads the configuration and window of up to [`MAX_TXN_OPS`] / 2 pools in one store round trip,
/// each pool's at its place. A pool whose records cannot be decoded fails alone.
pub async fn get_pools_and_windows(
    kv: &dyn Kv,
    pools: &[(TenantId, PoolId)],
) -> Result<Vec<Result<PoolAndWindow, PoolStoreError>>, PoolStoreError> {
    let keys: Vec<String> = pools
        .iter()
        .flat_map(|(tenant, pool)| [pool_key(tenant, pool), window_key(tenant, pool)])
        .collect();
    let values = kv.get_many(&keys).await?;
    Ok(keys
        .chunks(2)
        .zip(values.chunks(2))
        .map(|(keys, values)| {
            let pool = values[0]
                .as_ref()
                .map(|v| stored_pool(&keys[0], v))
                .transpose()?;
            let window = values[1]
                .as_ref()
                .map(|v| stored_window(&keys[1], v))
                .transpose()?;
            Ok((pool, window))
        })
        .collect())
}

/// Reads the grant records of many leases, [`MAX_TXN_OPS`] to a store round trip: each
/// `(tenant, pool, lease)` with its record, when the store has one.
pub async fn get_grants(
    kv: &dyn Kv,
    leases: &[(TenantId, PoolId, LeaseId)],
) -> Result<Vec<(TenantId, PoolId, GrantRecord)>, PoolStoreError> {
    let mut found = Vec::new();
    for chunk in leases.chunks(MAX_TXN_OPS) {
        let keys: Vec<String> = chunk
            .iter()
            .map(|(tenant, pool, lease)| grant_key(tenant, pool, lease))
            .collect();
        let values = kv.get_many(&keys).await?;
        for ((key, (tenant, pool, _)), value) in keys.iter().zip(chunk).zip(values) {
            if let Some(value) = value {
                found.push((tenant.clone(), pool.clone(), decode(key, &value.value)?));
            }
        }
    }
    Ok(found)
}

/// Reads one grant record.
pub async fn get_grant(
    kv: &dyn Kv,
    tenant: &TenantId,
    pool: &PoolId,
    lease: &LeaseId,
) -> Result<Option<GrantRecord>, PoolStoreError> {
    let key = grant_key(tenant, pool, lease);
    match kv.get(&key).await? {
        None => Ok(None),
        Some(v) => Ok(Some(decode(&key, &v.value)?)),
    }
}

/// Reads a pool's grant records, the newest first (at most [`MAX_PREFIX_KEYS`]: lease ids sort by
/// time, so a pool with more records in the store loses its oldest from the listing, never the
/// grants a new leader's ledger round must copy).
pub async fn list_grants(
    kv: &dyn Kv,
    tenant: &TenantId,
    pool: &PoolId,
) -> Result<Vec<GrantRecord>, PoolStoreError> {
    kv.get_prefix_newest(&grant_prefix(tenant, pool), MAX_PREFIX_KEYS)
        .await?
        .into_iter()
        .map(|(key, value)| decode(&key, &value.value))
        .collect()
}

/// One page of every pool's grant records: up to `limit` records after the store key `after`
/// (from the first when empty), in key order (so by pool), each with its pool; and the last key
/// read, to ask for the next page after (`None` when this page is the last).
pub async fn list_all_grants_page(
    kv: &dyn Kv,
    after: &str,
    limit: usize,
) -> Result<(Vec<(TenantId, PoolId, GrantRecord)>, Option<String>), PoolStoreError> {
    let page = kv.get_prefix_after(GRANTS_PREFIX, after, limit).await?;
    let full = page.len() >= limit.min(MAX_PREFIX_KEYS);
    let last = page.last().map(|(key, _)| key.clone());
    let mut records = Vec::with_capacity(page.len());
    for (key, value) in page {
        let (tenant, pool) = pool_of_key(&key, GRANTS_PREFIX, true)?;
        records.push((tenant, pool, decode(&key, &value.value)?));
    }
    Ok((records, last.filter(|_| full)))
}

pub(crate) fn encode_record<T: Serialize>(value: &T) -> Vec<u8> {
    encode(value)
}

//! Overrides in the store: operators' different limits for one tenant, user or API key
//! (`allot_shared::overrides`), created, listed and ended through the API, audited, and bounded.
//!
//! Store layout (values JSON):
//! - `/allot/overrides/items/<tenant>/<id>`: each override, in force or ended;
//! - `/allot/overrides/meta`: `{version, count}`: the version goes up by one with every change,
//!   and every change is a transaction guarded by this key's revision, so changes are serialised
//!   and the checks made before one (no override of the same target in force, the counts) still
//!   hold when it commits;
//! - a pool override is also written, in the same transaction, into its pool's record
//!   (`StoredPool::overrides`): grant workers read it with the pool's configuration under the
//!   same revision guard. The transaction is guarded by the pool's window record too, and the
//!   override starts (or ends) after the window the pool last granted in began, so a window whose
//!   grants were made under one limit is never held to another alone (`PoolRead`).
//!
//! Agents receive every stored rule override, ended ones included, as one
//! [`OverrideSet`] stamped with the meta version: the same
//! version always has the same content, and each agent lays only those in force on its clock.
//! Ended overrides are removed by the leader after
//! [`ENDED_OVERRIDE_KEPT_MS`] ([`remove_ended`]).

use std::sync::{Arc, Mutex};

use allot_shared::FieldError;
use allot_shared::ids::{PoolId, RecordId, RuleId, TenantId};
use allot_shared::overrides::{
    ENDED_OVERRIDE_KEPT_MS, ENDED_POOL_OVERRIDE_KEPT_MS, MAX_OVERRIDES, MAX_OVERRIDES_PER_TENANT,
    MAX_POOL_OVERRIDES_KEPT, OverridePrincipal, OverrideSet, PoolOverride, RuleAmounts,
    RuleOverride,
};
use allot_shared::policy::PolicyBundle;
use serde::{Deserialize, Serialize};

use crate::kv::{Compare, Kv, KvError, MAX_PREFIX_KEYS, Op, Versioned};
use crate::pools::{StoredPool, StoredWindow, pool_key, window_key};

const ITEM_PREFIX: &str = "/allot/overrides/items/";
const META_KEY: &str = "/allot/overrides/meta";
/// Longest `reason`, characters.
pub const MAX_REASON_CHARS: usize = 200;
/// Most ended overrides one cleanup round removes (one transaction).
pub const MAX_REMOVED_PER_ROUND: usize = 100;
/// Stored overrides read per store call when all of them are read (a page well within a store
/// answer's size, however long their reasons).
const ITEMS_PER_READ: usize = 1_000;

fn item_key(tenant: &TenantId, id: &RecordId) -> String {
    format!("{ITEM_PREFIX}{tenant}/{id}")
}

/// An override as stored and as the API shows it. Exactly one of `pool` and `rule`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Override {
    /// Its id: a UUID v7, so ids sort by creation.
    pub id: RecordId,
    /// Whose limit.
    pub tenant: TenantId,
    /// A pool of the tenant whose `G` it replaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pool: Option<PoolId>,
    /// A regional rule of the policy whose amounts it replaces for the tenant (or a principal).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule: Option<RuleId>,
    /// Only this principal (by keyed hash, never its id); none: all of the tenant's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<OverridePrincipal>,
    /// A pool's `G` (tokens per window), or a window rule's limit (units per window).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u64>,
    /// A rate rule's capacity, millitokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub capacity_millis: Option<u64>,
    /// A rate rule's refill per period, millitokens.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refill_millis: Option<u64>,
    /// When it came into force, epoch ms (allocator clock).
    pub starts_at_ms: u64,
    /// When it ends, or ended, epoch ms; none: until it is ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expires_at_ms: Option<u64>,
    /// Why, in the operator's words.
    pub reason: String,
    /// Who created it.
    pub created_by: String,
}

impl Override {
    /// Whether it is in force at `now_ms`.
    pub fn in_force_at(&self, now_ms: u64) -> bool {
        self.starts_at_ms <= now_ms && self.expires_at_ms.is_none_or(|end| now_ms < end)
    }

    /// Whether `other` limits the same thing: the same pool, or the same rule for the same
    /// principal (or for the whole tenant).
    fn same_target(&self, other: &Override) -> bool {
        self.tenant == other.tenant
            && self.pool == other.pool
            && self.rule == other.rule
            && self.principal == other.principal
    }

    fn pool_override(&self) -> Option<PoolOverride> {
        self.pool.as_ref()?;
        Some(PoolOverride {
            id: self.id,
            limit_tokens: self.limit?,
            starts_at_ms: self.starts_at_ms,
            expires_at_ms: self.expires_at_ms,
        })
    }

    fn rule_override(&self) -> Option<RuleOverride> {
        Some(RuleOverride {
            id: self.id,
            tenant: self.tenant.clone(),
            rule: self.rule.clone()?,
            principal: self.principal.clone(),
            amounts: self.amounts(),
            expires_at_ms: self.expires_at_ms,
        })
    }

    fn amounts(&self) -> RuleAmounts {
        RuleAmounts {
            capacity_millis: self.capacity_millis,
            refill_millis: self.refill_millis,
            limit: self.limit,
        }
    }
}

/// What an override limits.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// A pool's `G`, tokens per window.
    Pool {
        /// The pool.
        pool: PoolId,
        /// Its `G` while the override is in force.
        limit_tokens: u64,
    },
    /// A regional rule's amounts.
    Rule {
        /// The rule.
        rule: RuleId,
        /// Only this principal; none: the whole tenant.
        principal: Option<OverridePrincipal>,
        /// The amounts.
        amounts: RuleAmounts,
    },
}

/// An override to create.
#[derive(Debug, Clone)]
pub struct NewOverride {
    /// Whose limit.
    pub tenant: TenantId,
    /// What it limits.
    pub target: Target,
    /// When it ends, epoch ms; none: until it is ended.
    pub expires_at_ms: Option<u64>,
    /// Why.
    pub reason: String,
    /// Who.
    pub created_by: String,
}

/// The store's count of changes and of stored overrides, and when the first stored one is due
/// to be removed (so a cleanup round before then is one read).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Meta {
    version: u64,
    count: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    next_removal_ms: Option<u64>,
}

impl Meta {
    /// The next version, with an override that ends at `end_ms` (if it ends) in the count of
    /// what is due for removal.
    fn changed(self, count: u64, end_ms: Option<u64>) -> Self {
        let due = end_ms.map(|end| end.saturating_add(ENDED_OVERRIDE_KEPT_MS));
        Self {
            version: self.version + 1,
            count,
            next_removal_ms: match (self.next_removal_ms, due) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            },
        }
    }
}

/// Why an override operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum OverrideStoreError {
    /// A field is invalid (named).
    #[error("{0}")]
    Invalid(FieldError),
    /// The pool does not exist.
    #[error("no such pool")]
    UnknownPool,
    /// No such override.
    #[error("no such override")]
    NotFound,
    /// Another override of the same target is in force, or a bound is reached.
    #[error("{0}")]
    Conflict(String),
    /// The store failed.
    #[error(transparent)]
    Store(#[from] KvError),
    /// A stored value is unreadable.
    #[error("stored value at {0} is not readable")]
    Corrupt(String),
    /// Concurrent changes kept winning.
    #[error("overrides changed concurrently too often; retry")]
    Contended,
}

impl From<crate::pools::PoolStoreError> for OverrideStoreError {
    fn from(error: crate::pools::PoolStoreError) -> Self {
        match error {
            crate::pools::PoolStoreError::Store(e) => Self::Store(e),
            crate::pools::PoolStoreError::Corrupt(key) => Self::Corrupt(key),
            other => Self::Corrupt(other.to_string()),
        }
    }
}

fn decode<T: for<'de> Deserialize<'de>>(key: &str, bytes: &[u8]) -> Result<T, OverrideStoreError> {
    serde_json::from_slice(bytes).map_err(|_| OverrideStoreError::Corrupt(key.to_owned()))
}

fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    // Serializing these plain records cannot fail.
    serde_json::to_vec(value).unwrap_or_default()
}

async fn meta(kv: &dyn Kv) -> Result<(Meta, i64), OverrideStoreError> {
    match kv.get(META_KEY).await? {
        Some(value) => Ok((decode(META_KEY, &value.value)?, value.mod_revision)),
        None => Ok((Meta::default(), 0)),
    }
}

fn meta_guard(revision: i64) -> Compare {
    Compare::ModRevision {
        key: META_KEY.to_owned(),
        revision,
    }
}

fn put(key: String, value: Vec<u8>) -> Op {
    Op::Put {
        key,
        value,
        lease: None,
    }
}

/// Every stored override under `prefix` (at most [`MAX_OVERRIDES`]), a page of
/// [`ITEMS_PER_READ`] a store call.
async fn every_item(
    kv: &dyn Kv,
    prefix: &str,
) -> Result<Vec<(String, Versioned)>, OverrideStoreError> {
    let mut items: Vec<(String, Versioned)> = Vec::new();
    loop {
        let after = items.last().map(|(key, _)| key.clone()).unwrap_or_default();
        let page = kv.get_prefix_after(prefix, &after, ITEMS_PER_READ).await?;
        let full = page.len() == ITEMS_PER_READ;
        items.extend(page);
        if !full || items.len() >= MAX_OVERRIDES {
            return Ok(items);
        }
    }
}

/// The tenant's stored overrides.
async fn of_tenant(kv: &dyn Kv, tenant: &TenantId) -> Result<Vec<Override>, OverrideStoreError> {
    every_item(kv, &format!("{ITEM_PREFIX}{tenant}/"))
        .await?
        .iter()
        .map(|(key, value)| decode(key, &value.value))
        .collect()
}

/// `pool`'s overrides with `change` applied. Ended ones stay on the pool for
/// [`ENDED_POOL_OVERRIDE_KEPT_MS`] (the ledger's windows, rolled up, are accounted against them as
/// long); a pool keeping [`MAX_POOL_OVERRIDES_KEPT`] already refuses another rather than forget
/// one a kept window was held to.
fn kept_on_pool(
    pool: &StoredPool,
    change: PoolOverride,
    now_ms: u64,
) -> Result<Vec<PoolOverride>, OverrideStoreError> {
    let changed = change.id;
    let mut kept: Vec<PoolOverride> = pool
        .overrides
        .iter()
        .filter(|o| o.id != changed)
        .filter(|o| {
            o.expires_at_ms
                .is_none_or(|end| end.saturating_add(ENDED_POOL_OVERRIDE_KEPT_MS) > now_ms)
        })
        .cloned()
        .chain(std::iter::once(change))
        .collect();
    kept.sort_by_key(|o| o.starts_at_ms);
    if kept.len() > MAX_POOL_OVERRIDES_KEPT {
        let frees_at_ms = kept
            .iter()
            .filter_map(|o| o.expires_at_ms)
            .min()
            .map_or(u64::MAX, |end| {
                end.saturating_add(ENDED_POOL_OVERRIDE_KEPT_MS)
            });
        return Err(OverrideStoreError::Conflict(format!(
            "the pool keeps {MAX_POOL_OVERRIDES_KEPT} overrides for the accounting of the windows \
             they touched; the oldest may go at {}",
            allot_shared::window::rfc3339_utc(frees_at_ms)
        )));
    }
    Ok(kept)
}

/// A pool's record and window, read together: what an override of its limit is written over.
struct PoolRead {
    stored: StoredPool,
    pool_revision: i64,
    window_revision: i64,
    window_start_ms: Option<u64>,
}

impl PoolRead {
    async fn of(kv: &dyn Kv, tenant: &TenantId, pool: &PoolId) -> Result<Self, OverrideStoreError> {
        let keys = [pool_key(tenant, pool), window_key(tenant, pool)];
        let mut read = kv.get_many(&keys).await?.into_iter();
        let (Some(Some(pool_value)), window_value) = (read.next(), read.next().flatten()) else {
            return Err(OverrideStoreError::UnknownPool);
        };
        let window = window_value
            .as_ref()
            .map(|value| decode::<StoredWindow>(&keys[1], &value.value))
            .transpose()?;
        Ok(Self {
            stored: decode(&keys[0], &pool_value.value)?,
            pool_revision: pool_value.mod_revision,
            window_revision: window_value.map_or(0, |value| value.mod_revision),
            window_start_ms: window.map(|w| w.window_start_ms),
        })
    }

    /// When an override written now takes effect on this pool: `now_ms`, or just after the start
    /// of the window the pool last granted in when that is later (the leader that granted it may
    /// run a clock ahead of this one). So a window whose grants were made under the old limit is
    /// never held to the new one alone; a grant after this read fails the write's guard, and the
    /// change is made again over what it left.
    fn effective_ms(&self, now_ms: u64) -> u64 {
        self.window_start_ms
            .map_or(now_ms, |start| now_ms.max(start.saturating_add(1)))
    }

    /// The guards (the pool's record and its window, as read) and the write of the record with
    /// `change` in its overrides.
    fn write(
        mut self,
        tenant: &TenantId,
        pool: &PoolId,
        change: PoolOverride,
        now_ms: u64,
    ) -> Result<(Vec<Compare>, Op), OverrideStoreError> {
        self.stored.overrides = kept_on_pool(&self.stored, change, now_ms)?;
        self.stored.version += 1;
        self.stored.updated_at_ms = now_ms;
        let key = pool_key(tenant, pool);
        let guards = vec![
            Compare::ModRevision {
                key: key.clone(),
                revision: self.pool_revision,
            },
            Compare::ModRevision {
                key: window_key(tenant, pool),
                revision: self.window_revision,
            },
        ];
        Ok((guards, put(key, encode(&self.stored))))
    }
}

/// Checks `new` against `bundle` (the policy in force everywhere), when it overrides a rule: the
/// rule exists, is regional, applies to the tenant, is per principal when a principal is named,
/// and takes the amounts. Errors name the API's fields.
pub fn check_rule_target(
    new: &NewOverride,
    bundle: Option<&PolicyBundle>,
) -> Result<(), OverrideStoreError> {
    let Target::Rule {
        rule,
        principal,
        amounts,
    } = &new.target
    else {
        return Ok(());
    };
    let invalid = |field: &str, message: String| {
        OverrideStoreError::Invalid(FieldError::new(field.to_owned(), message))
    };
    let bundle = bundle.ok_or_else(|| {
        invalid(
            "rule",
            "no policy bundle is published yet: there is no rule to override".to_owned(),
        )
    })?;
    let found = bundle
        .rules()
        .iter()
        .find(|r| &r.id == rule)
        .ok_or_else(|| {
            invalid(
                "rule",
                format!(
                    "the current policy bundle (version {}) has no rule {rule}",
                    bundle.version()
                ),
            )
        })?;
    if found
        .matcher
        .tenant
        .as_ref()
        .is_some_and(|t| t != &new.tenant)
    {
        return Err(invalid(
            "tenant",
            format!("rule {rule} applies to another tenant only"),
        ));
    }
    if let Some(principal) = principal {
        if found.scope != allot_shared::policy::Scope::User {
            return Err(invalid(
                "principal",
                format!(
                    "rule {rule} is not per principal: its budget is shared, so only the whole tenant's can be overridden"
                ),
            ));
        }
        if !principal.kind.is_authenticated() {
            return Err(invalid(
                "principal.type",
                "must be user or api_key: anonymous callers get no overrides".to_owned(),
            ));
        }
    }
    found
        .with_amounts(amounts)
        .map(drop)
        .map_err(|e| invalid(&e.field, e.message))
}

/// Creates an override at `now_ms` with `id`, after checking the bounds and that no override of
/// the same target is in force (a rule override must already have passed
/// [`check_rule_target`]).
///
/// Long by design: each attempt's checks (the store's cap, the same target in force, the tenant's
/// cap) are made on that attempt's reads, and its transaction is guarded by the revisions read in
/// the same attempt (the overrides' meta record and, for a pool, the pool's); split, a check could
/// be made on one read and the write guarded by another.
pub async fn create(
    kv: &dyn Kv,
    new: NewOverride,
    id: RecordId,
    now_ms: u64,
) -> Result<Override, OverrideStoreError> {
    let (pool, rule, principal, amounts) = match &new.target {
        Target::Pool { pool, limit_tokens } => (
            Some(pool.clone()),
            None,
            None,
            RuleAmounts {
                limit: Some(*limit_tokens),
                ..RuleAmounts::default()
            },
        ),
        Target::Rule {
            rule,
            principal,
            amounts,
        } => (None, Some(rule.clone()), principal.clone(), amounts.clone()),
    };
    let mut created = Override {
        id,
        tenant: new.tenant.clone(),
        pool,
        rule,
        principal,
        limit: amounts.limit,
        capacity_millis: amounts.capacity_millis,
        refill_millis: amounts.refill_millis,
        starts_at_ms: now_ms,
        expires_at_ms: new.expires_at_ms,
        reason: new.reason,
        created_by: new.created_by,
    };
    for _ in 0..8 {
        let (meta, meta_revision) = meta(kv).await?;
        // A pool override takes effect after the pool's latest grants (see PoolRead).
        let pool_read = match &created.pool {
            Some(pool) => Some(PoolRead::of(kv, &created.tenant, pool).await?),
            None => None,
        };
        let at_ms = pool_read
            .as_ref()
            .map_or(now_ms, |read| read.effective_ms(now_ms));
        created.starts_at_ms = at_ms;
        created.expires_at_ms = new.expires_at_ms.map(|end| end.max(at_ms + 1));
        if meta.count >= MAX_OVERRIDES as u64 {
            return Err(OverrideStoreError::Conflict(format!(
                "{MAX_OVERRIDES} overrides are stored already (ended ones are removed {} days after they end)",
                ENDED_OVERRIDE_KEPT_MS / 86_400_000
            )));
        }
        let tenants = of_tenant(kv, &created.tenant).await?;
        let in_force: Vec<&Override> = tenants.iter().filter(|o| o.in_force_at(at_ms)).collect();
        if let Some(same) = in_force.iter().find(|o| o.same_target(&created)) {
            return Err(OverrideStoreError::Conflict(format!(
                "override {} of the same target is in force; end it first",
                same.id
            )));
        }
        if in_force.len() >= MAX_OVERRIDES_PER_TENANT {
            return Err(OverrideStoreError::Conflict(format!(
                "tenant {} has {MAX_OVERRIDES_PER_TENANT} overrides in force already",
                created.tenant
            )));
        }
        let mut compares = vec![meta_guard(meta_revision)];
        let mut ops = vec![
            put(item_key(&created.tenant, &created.id), encode(&created)),
            put(
                META_KEY.to_owned(),
                encode(&meta.changed(meta.count + 1, created.expires_at_ms)),
            ),
        ];
        if let (Some(read), Some(pool), Some(change)) =
            (pool_read, &created.pool, created.pool_override())
        {
            let (guards, write) = read.write(&created.tenant, pool, change, at_ms)?;
            compares.extend(guards);
            ops.push(write);
        }
        if kv.txn(compares, ops).await?.succeeded {
            return Ok(created);
        }
    }
    Err(OverrideStoreError::Contended)
}

/// One override.
pub async fn get(
    kv: &dyn Kv,
    tenant: &TenantId,
    id: &RecordId,
) -> Result<Option<Override>, OverrideStoreError> {
    let key = item_key(tenant, id);
    kv.get(&key)
        .await?
        .map(|value| decode(&key, &value.value))
        .transpose()
}

/// Ends an override at `now_ms` (it stays listed, ended, until it is removed). Ending one that
/// has ended already changes nothing.
pub async fn end(
    kv: &dyn Kv,
    tenant: &TenantId,
    id: &RecordId,
    now_ms: u64,
) -> Result<Override, OverrideStoreError> {
    for _ in 0..8 {
        let (meta, meta_revision) = meta(kv).await?;
        let mut stored = get(kv, tenant, id)
            .await?
            .ok_or(OverrideStoreError::NotFound)?;
        if stored.expires_at_ms.is_some_and(|end| end <= now_ms) {
            return Ok(stored);
        }
        // A pool override ends after the pool's latest grants under it (see PoolRead); one not
        // started yet (a clock step back could make one) ends as it starts.
        let pool_read = match &stored.pool {
            Some(pool) => match PoolRead::of(kv, tenant, pool).await {
                Ok(read) => Some(read),
                // The pool is gone, and its overrides with it.
                Err(OverrideStoreError::UnknownPool) => None,
                Err(other) => return Err(other),
            },
            None => None,
        };
        let at_ms = pool_read
            .as_ref()
            .map_or(now_ms, |read| read.effective_ms(now_ms));
        let end_ms = at_ms.max(stored.starts_at_ms);
        stored.expires_at_ms = Some(stored.expires_at_ms.map_or(end_ms, |due| due.min(end_ms)));
        let mut compares = vec![meta_guard(meta_revision)];
        let mut ops = vec![
            put(item_key(tenant, id), encode(&stored)),
            put(
                META_KEY.to_owned(),
                encode(&meta.changed(meta.count, stored.expires_at_ms)),
            ),
        ];
        if let (Some(read), Some(pool), Some(change)) =
            (pool_read, &stored.pool, stored.pool_override())
        {
            let (guards, write) = read.write(tenant, pool, change, at_ms)?;
            compares.extend(guards);
            ops.push(write);
        }
        if kv.txn(compares, ops).await?.succeeded {
            return Ok(stored);
        }
    }
    Err(OverrideStoreError::Contended)
}

/// A page of overrides (of one tenant, or of all), in key order after `cursor` (the last
/// listed's `<tenant>/<id>`), and the cursor of the next page when there may be one.
pub async fn list(
    kv: &dyn Kv,
    tenant: Option<&TenantId>,
    cursor: Option<&str>,
    limit: usize,
) -> Result<(Vec<Override>, Option<String>), OverrideStoreError> {
    let prefix = match tenant {
        Some(tenant) => format!("{ITEM_PREFIX}{tenant}/"),
        None => ITEM_PREFIX.to_owned(),
    };
    let after = cursor
        .map(|c| format!("{ITEM_PREFIX}{c}"))
        .unwrap_or_default();
    let limit = limit.clamp(1, MAX_PREFIX_KEYS);
    let page = kv.get_prefix_after(&prefix, &after, limit).await?;
    let next = (page.len() == limit)
        .then(|| {
            page.last()
                .map(|(key, _)| key[ITEM_PREFIX.len()..].to_owned())
        })
        .flatten();
    let overrides = page
        .iter()
        .map(|(key, value)| decode(key, &value.value))
        .collect::<Result<Vec<Override>, _>>()?;
    Ok((overrides, next))
}

/// The rule overrides agents receive, built once per store version.
#[derive(Debug, Default)]
pub struct SetCache {
    built: Mutex<Option<Arc<OverrideSet>>>,
}

impl SetCache {
    /// Every stored rule override as one set at the store's version: from the cache when the
    /// version is unchanged (one read), else read whole (at most [`MAX_OVERRIDES`]).
    pub async fn current(&self, kv: &dyn Kv) -> Result<Arc<OverrideSet>, OverrideStoreError> {
        let mut attempts = 0;
        loop {
            let (before, _) = meta(kv).await?;
            if let Some(set) = self.cached().filter(|set| set.version == before.version) {
                return Ok(set);
            }
            let items = every_item(kv, ITEM_PREFIX).await?;
            let overrides = items
                .iter()
                .map(|(key, value)| decode::<Override>(key, &value.value))
                .filter_map(|o| o.map(|o| o.rule_override()).transpose())
                .collect::<Result<Vec<RuleOverride>, _>>()?;
            let set = Arc::new(OverrideSet::seal(before.version, overrides));
            // Every change moves the version: the same version read after the listing means the
            // listing is that version's content, and may be kept as it.
            let (after, _) = meta(kv).await?;
            attempts += 1;
            if after.version == before.version {
                *self.lock() = Some(Arc::clone(&set));
                return Ok(set);
            }
            if attempts == 3 {
                // Still changing: the listing is at least as new as `before`, so an agent that
                // takes it asks again for the newer version; it is not kept as `before`'s.
                return Ok(set);
            }
        }
    }

    fn cached(&self) -> Option<Arc<OverrideSet>> {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<Arc<OverrideSet>>> {
        self.built
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Removes up to [`MAX_REMOVED_PER_ROUND`] overrides that ended more than
/// [`ENDED_OVERRIDE_KEPT_MS`] before `now_ms`, in one transaction; returns how many. Before the
/// first is due, one read.
pub async fn remove_ended(kv: &dyn Kv, now_ms: u64) -> Result<usize, OverrideStoreError> {
    let (meta, meta_revision) = meta(kv).await?;
    if meta.next_removal_ms.is_none_or(|due| now_ms < due) {
        return Ok(0);
    }
    let mut old: Vec<(String, i64)> = Vec::new();
    let mut next_removal_ms: Option<u64> = None;
    for (key, value) in every_item(kv, ITEM_PREFIX).await? {
        let Some(due) = decode::<Override>(&key, &value.value)?
            .expires_at_ms
            .map(|end| end.saturating_add(ENDED_OVERRIDE_KEPT_MS))
        else {
            continue;
        };
        if due <= now_ms && old.len() < MAX_REMOVED_PER_ROUND {
            old.push((key, value.mod_revision));
        } else {
            next_removal_ms = Some(next_removal_ms.map_or(due, |next| next.min(due)));
        }
    }
    let mut compares = vec![meta_guard(meta_revision)];
    let mut ops = vec![put(
        META_KEY.to_owned(),
        encode(&Meta {
            version: meta.version + 1,
            count: meta.count.saturating_sub(old.len() as u64),
            next_removal_ms,
        }),
    )];
    for (key, revision) in &old {
        compares.push(Compare::ModRevision {
            key: key.clone(),
            revision: *revision,
        });
        ops.push(Op::Delete { key: key.clone() });
    }
    Ok(if kv.txn(compares, ops).await?.succeeded {
        old.len()
    } else {
        0
    })
}

#[cfg(test)]
mod tests;

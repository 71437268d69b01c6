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
//!   same revision guard, so a grant never races an override's start or end.
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
    ENDED_OVERRIDE_KEPT_MS, MAX_OVERRIDES, MAX_OVERRIDES_PER_TENANT, MAX_POOL_OVERRIDES_KEPT,
    OverridePrincipal, OverrideSet, PoolOverride, RuleAmounts, RuleOverride,
};
use allot_shared::policy::PolicyBundle;
use serde::{Deserialize, Serialize};

use crate::kv::{Compare, Kv, KvError, MAX_PREFIX_KEYS, Op};
use crate::pools::{StoredPool, get_pool, pool_key};

const ITEM_PREFIX: &str = "/allot/overrides/items/";
const META_KEY: &str = "/allot/overrides/meta";
/// Longest `reason`, characters.
pub const MAX_REASON_CHARS: usize = 200;
/// Most ended overrides one cleanup round removes (one transaction).
pub const MAX_REMOVED_PER_ROUND: usize = 100;

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

/// The tenant's stored overrides (at most [`MAX_OVERRIDES`], so one read).
async fn of_tenant(kv: &dyn Kv, tenant: &TenantId) -> Result<Vec<Override>, OverrideStoreError> {
    kv.get_prefix(&format!("{ITEM_PREFIX}{tenant}/"), MAX_PREFIX_KEYS)
        .await?
        .iter()
        .map(|(key, value)| decode(key, &value.value))
        .collect()
}

/// `pool`'s overrides with `change` applied, ended ones kept at most
/// [`ENDED_OVERRIDE_KEPT_MS`] and at most [`MAX_POOL_OVERRIDES_KEPT`] in all (the oldest ended
/// first out).
fn kept_on_pool(pool: &StoredPool, change: PoolOverride, now_ms: u64) -> Vec<PoolOverride> {
    let changed = change.id;
    let mut kept: Vec<PoolOverride> = pool
        .overrides
        .iter()
        .filter(|o| o.id != changed)
        .filter(|o| {
            o.expires_at_ms
                .is_none_or(|end| end.saturating_add(ENDED_OVERRIDE_KEPT_MS) > now_ms)
        })
        .cloned()
        .chain(std::iter::once(change))
        .collect();
    kept.sort_by_key(|o| o.starts_at_ms);
    while kept.len() > MAX_POOL_OVERRIDES_KEPT {
        // Never more than one in force per pool, so an ended one is always there to drop.
        match kept.iter().position(|o| !o.in_force_at(now_ms)) {
            Some(oldest_ended) => kept.remove(oldest_ended),
            None => break,
        };
    }
    kept
}

/// The pool's record with `change` written into its overrides, and the guard and put of it.
async fn pool_write(
    kv: &dyn Kv,
    tenant: &TenantId,
    pool: &PoolId,
    change: PoolOverride,
    now_ms: u64,
) -> Result<(Compare, Op), OverrideStoreError> {
    let (mut stored, revision) = get_pool(kv, tenant, pool)
        .await?
        .ok_or(OverrideStoreError::UnknownPool)?;
    stored.overrides = kept_on_pool(&stored, change, now_ms);
    stored.version += 1;
    stored.updated_at_ms = now_ms;
    let key = pool_key(tenant, pool);
    Ok((
        Compare::ModRevision {
            key: key.clone(),
            revision,
        },
        put(key, encode(&stored)),
    ))
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
    let created = Override {
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
        if meta.count >= MAX_OVERRIDES as u64 {
            return Err(OverrideStoreError::Conflict(format!(
                "{MAX_OVERRIDES} overrides are stored already (ended ones are removed {} days after they end)",
                ENDED_OVERRIDE_KEPT_MS / 86_400_000
            )));
        }
        let tenants = of_tenant(kv, &created.tenant).await?;
        let in_force: Vec<&Override> = tenants.iter().filter(|o| o.in_force_at(now_ms)).collect();
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
        if let (Some(pool), Some(change)) = (&created.pool, created.pool_override()) {
            let (guard, write) = pool_write(kv, &created.tenant, pool, change, now_ms).await?;
            compares.push(guard);
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
        // Ended now; one not started yet (none are, but a clock step back could make one) ends
        // before it starts.
        stored.expires_at_ms = Some(now_ms.max(stored.starts_at_ms));
        let mut compares = vec![meta_guard(meta_revision)];
        let mut ops = vec![
            put(item_key(tenant, id), encode(&stored)),
            put(
                META_KEY.to_owned(),
                encode(&meta.changed(meta.count, stored.expires_at_ms)),
            ),
        ];
        if let (Some(pool), Some(change)) = (&stored.pool, stored.pool_override()) {
            match pool_write(kv, tenant, pool, change, now_ms).await {
                Ok((guard, write)) => {
                    compares.push(guard);
                    ops.push(write);
                }
                // The pool is gone, and its overrides with it.
                Err(OverrideStoreError::UnknownPool) => {}
                Err(other) => return Err(other),
            }
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
            let items = kv.get_prefix(ITEM_PREFIX, MAX_PREFIX_KEYS).await?;
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
    for (key, value) in kv.get_prefix(ITEM_PREFIX, MAX_PREFIX_KEYS).await? {
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
mod tests {
    use allot_shared::clock::ManualClock;
    use allot_shared::contract::PrincipalType;
    use allot_shared::keys::PrincipalHash;

    use super::*;
    use crate::kv::memory::MemoryKv;
    use crate::pools::{PoolSpec, put_pool};

    fn tenant() -> TenantId {
        TenantId::parse("acme").expect("tenant")
    }

    fn pool() -> PoolId {
        PoolId::parse("api").expect("pool")
    }

    fn id(n: u64) -> RecordId {
        RecordId::from_parts(1_000 + n, u128::from(n))
    }

    fn raise(limit_tokens: u64, expires_at_ms: Option<u64>) -> NewOverride {
        NewOverride {
            tenant: tenant(),
            target: Target::Pool {
                pool: pool(),
                limit_tokens,
            },
            expires_at_ms,
            reason: "launch week".to_owned(),
            created_by: "operator:test".to_owned(),
        }
    }

    async fn store_with_pool() -> MemoryKv {
        let kv = MemoryKv::new(Arc::new(ManualClock::new(0)));
        let spec: PoolSpec = serde_json::from_value(serde_json::json!({
            "limit": 1000, "windowMs": 60000, "chunk": 100, "leaseTtlMs": 5000,
            "fallbackPerRegion": 0, "regions": ["eu"] }))
        .expect("spec");
        put_pool(&kv, &tenant(), &pool(), spec, 0)
            .await
            .expect("pool");
        kv
    }

    #[tokio::test]
    async fn a_pool_override_reaches_the_pool_record_and_ends_there_too() {
        let kv = store_with_pool().await;
        let created = create(&kv, raise(5_000, Some(90_000)), id(1), 10_000)
            .await
            .expect("created");
        let (stored, _) = get_pool(&kv, &tenant(), &pool())
            .await
            .expect("read")
            .expect("pool");
        assert_eq!(stored.version, 2, "the pool's version went up");
        assert_eq!(stored.limit_at(9_999), 1_000);
        assert_eq!(stored.limit_at(10_000), 5_000);
        assert_eq!(stored.limit_at(90_000), 1_000);

        // A second one of the same pool is refused while the first is in force.
        let again = create(&kv, raise(7_000, None), id(2), 20_000).await;
        assert!(
            matches!(again, Err(OverrideStoreError::Conflict(_))),
            "{again:?}"
        );

        let ended = end(&kv, &tenant(), &created.id, 30_000)
            .await
            .expect("ended");
        assert_eq!(ended.expires_at_ms, Some(30_000));
        let (stored, _) = get_pool(&kv, &tenant(), &pool())
            .await
            .expect("read")
            .expect("pool");
        assert_eq!(stored.limit_at(29_999), 5_000);
        assert_eq!(stored.limit_at(30_000), 1_000);
        // Ending twice changes nothing; now a new one may start.
        assert_eq!(end(&kv, &tenant(), &created.id, 40_000).await, Ok(ended));
        create(&kv, raise(7_000, None), id(2), 40_000)
            .await
            .expect("a new one once the first ended");
        let unknown = NewOverride {
            target: Target::Pool {
                pool: PoolId::parse("nope").expect("pool"),
                limit_tokens: 5,
            },
            ..raise(5, None)
        };
        assert_eq!(
            create(&kv, unknown, id(3), 40_000).await,
            Err(OverrideStoreError::UnknownPool)
        );
    }

    #[tokio::test]
    async fn the_set_agents_get_is_every_rule_override_at_the_stores_version() {
        let kv = store_with_pool().await;
        let cache = SetCache::default();
        assert_eq!(cache.current(&kv).await.expect("set").version, 0);
        create(&kv, raise(5_000, None), id(1), 1_000)
            .await
            .expect("pool override");
        let rule = NewOverride {
            target: Target::Rule {
                rule: RuleId::parse("read-user").expect("rule"),
                principal: Some(OverridePrincipal {
                    kind: PrincipalType::User,
                    hash: PrincipalHash::parse("00000000000000aa").expect("hash"),
                }),
                amounts: RuleAmounts {
                    capacity_millis: Some(50_000),
                    ..RuleAmounts::default()
                },
            },
            ..raise(0, Some(5_000))
        };
        create(&kv, rule, id(2), 1_000)
            .await
            .expect("rule override");
        let set = cache.current(&kv).await.expect("set");
        assert_eq!(set.version, 2);
        assert_eq!(
            set.overrides.len(),
            1,
            "pool overrides are the allocator's own"
        );
        assert_eq!(set.overrides[0].id, id(2));
        assert!(set.as_ref().clone().verify().is_ok());
        // The same version is the same set, even after the override ended on the clock.
        assert_eq!(cache.current(&kv).await.expect("set"), set);

        // Ended ones leave the store after they were kept long enough, with a new version.
        assert_eq!(
            remove_ended(&kv, 5_000 + ENDED_OVERRIDE_KEPT_MS - 1).await,
            Ok(0)
        );
        assert_eq!(
            remove_ended(&kv, 5_000 + ENDED_OVERRIDE_KEPT_MS).await,
            Ok(1)
        );
        let after = cache.current(&kv).await.expect("set");
        assert_eq!((after.version, after.overrides.len()), (3, 0));
        let (listed, next) = list(&kv, None, None, 10).await.expect("list");
        assert_eq!((listed.len(), next), (1, None));
    }

    #[tokio::test]
    async fn listing_pages_with_a_cursor_and_bounds_hold() {
        let kv = store_with_pool().await;
        for n in 0..5 {
            let rule = NewOverride {
                tenant: TenantId::parse(&format!("t{n}")).expect("tenant"),
                target: Target::Rule {
                    rule: RuleId::parse("r").expect("rule"),
                    principal: None,
                    amounts: RuleAmounts {
                        limit: Some(n + 1),
                        ..RuleAmounts::default()
                    },
                },
                ..raise(0, None)
            };
            create(&kv, rule, id(n), 1_000).await.expect("created");
        }
        let (first, next) = list(&kv, None, None, 2).await.expect("page");
        let (second, next) = list(&kv, None, next.as_deref(), 2).await.expect("page");
        let (third, next) = list(&kv, None, next.as_deref(), 2).await.expect("page");
        let tenants: Vec<String> = first
            .iter()
            .chain(&second)
            .chain(&third)
            .map(|o| o.tenant.to_string())
            .collect();
        assert_eq!(tenants, ["t0", "t1", "t2", "t3", "t4"]);
        assert_eq!(next, None);
        let (one, _) = list(&kv, Some(&TenantId::parse("t3").expect("t")), None, 10)
            .await
            .expect("tenant");
        assert_eq!(one.len(), 1);
    }

    #[test]
    fn a_pool_keeps_its_override_in_force_and_a_bounded_few_ended() {
        let spec: PoolSpec = serde_json::from_value(serde_json::json!({
            "limit": 1000, "windowMs": 60000, "chunk": 100, "leaseTtlMs": 5000,
            "fallbackPerRegion": 0, "regions": ["eu"] }))
        .expect("spec");
        let mut pool = StoredPool {
            spec,
            version: 1,
            updated_at_ms: 0,
            overrides: Vec::new(),
        };
        let now_ms = 1_000_000;
        for n in 0..20 {
            let change = PoolOverride {
                id: id(n),
                limit_tokens: n + 1,
                starts_at_ms: n * 10,
                expires_at_ms: Some(n * 10 + 5),
            };
            pool.overrides = kept_on_pool(&pool, change, now_ms);
        }
        let open = PoolOverride {
            id: id(99),
            limit_tokens: 5,
            starts_at_ms: 500,
            expires_at_ms: None,
        };
        pool.overrides = kept_on_pool(&pool, open, now_ms);
        assert_eq!(pool.overrides.len(), MAX_POOL_OVERRIDES_KEPT);
        assert!(
            pool.overrides.iter().any(|o| o.id == id(99)),
            "the one in force stays"
        );
        assert!(
            pool.overrides.iter().any(|o| o.id == id(19)),
            "the newest ended stay"
        );
        // Long ended ones go.
        let later = now_ms + ENDED_OVERRIDE_KEPT_MS;
        let touch = PoolOverride {
            expires_at_ms: Some(later),
            ..pool.overrides[MAX_POOL_OVERRIDES_KEPT - 1].clone()
        };
        let kept = kept_on_pool(&pool, touch, later);
        assert_eq!(kept.len(), 1);
    }
}

//! The cardinality cap of pre-authentication rules: one source may not create more than a few new
//! keys per interval, so bogus identities cannot grow the key set.
//!
//! Pre-authentication (`ip`) rules key their buckets by a keyed hash of the client's address prefix.
//! An attacker who controls many addresses (an IPv6 /48 holds 65,536 /64s) could mint a fresh, full
//! bucket per address, and every fresh bucket is a new Redis key. The cap counts, per **source**,
//! the distinct per-principal keys of `ip` requests within a fixed window of `interval_ms` that starts
//! at the source's first such key, and refuses a request that would take the count past
//! `max_keys_per_source`. The refused request is denied (`RATE_EXCEEDED`, scope `user`) without a
//! store call, and writes nothing.
//!
//! - **Source** ([`SourceId`]): a keyed hash of a coarser prefix than the keys use (by default /24
//!   for IPv4 and /48 for IPv6, [`DEFAULT_SOURCE_PREFIXES`]), so the addresses one party controls
//!   share one count. Without a source, the request's own principal hash stands in (then the cap
//!   limits keys per identity, which only bites when the identity maps to many keys).
//! - **"New"** is approximated by "distinct within the source's window": whether Redis still holds a
//!   key is unknown without a round trip, and counting keys the source already has is stricter, never
//!   looser. A source that keeps reusing its keys is never refused.
//! - **Bounded (I10), in process.** Each source holds at most `max_keys_per_source` key hashes; at most
//!   `max_sources` sources are tracked. When the table is full, the source whose window started
//!   longest ago is dropped if its window has ended (forgetting it changes nothing); otherwise a new
//!   source is refused until one ends. So each agent admits at most `max_sources x
//!   max_keys_per_source` new pre-authentication keys per interval, whatever the flood. (A Redis
//!   counter would be fleet-wide but would cost a second round trip on the pre-authentication path;
//!   the key growth it prevents is per agent anyway.)

use std::sync::{Mutex, MutexGuard, PoisonError};

use allot_shared::contract::PrincipalType;
use allot_shared::keys::{self, IpPrefixes, Pepper};

use super::bounded::BoundedMap;
use super::hot_tenants::fnv1a;

/// Most keys one source may hold per window, a bound on the configuration (I10).
pub const MAX_KEYS_PER_SOURCE: u32 = 4_096;

/// Default new pre-authentication keys one source may create per interval.
pub const DEFAULT_MAX_KEYS_PER_SOURCE: u32 = 64;

/// Default interval of the cap, in ms.
pub const DEFAULT_CARDINALITY_INTERVAL_MS: u64 = 60_000;

/// Default cap on tracked sources per agent (I10).
pub const DEFAULT_MAX_SOURCES: usize = 10_000;

/// Default prefixes that group addresses into one source: coarser than the keys' (/32, /64).
pub const DEFAULT_SOURCE_PREFIXES: IpPrefixes = IpPrefixes {
    v4_bits: 24,
    v6_bits: 48,
};

/// The cap's configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CardinalityConfig {
    /// New keys per source per interval, 1 to [`MAX_KEYS_PER_SOURCE`].
    pub max_keys_per_source: u32,
    /// The window, in ms (at least 1).
    pub interval_ms: u64,
    /// Sources tracked at once.
    pub max_sources: usize,
}

impl Default for CardinalityConfig {
    fn default() -> Self {
        Self {
            max_keys_per_source: DEFAULT_MAX_KEYS_PER_SOURCE,
            interval_ms: DEFAULT_CARDINALITY_INTERVAL_MS,
            max_sources: DEFAULT_MAX_SOURCES,
        }
    }
}

impl CardinalityConfig {
    /// Checks the bounds; returns what is wrong.
    pub fn validate(&self) -> Result<(), &'static str> {
        if !(1..=MAX_KEYS_PER_SOURCE).contains(&self.max_keys_per_source) {
            return Err("cardinality max_keys_per_source must be in [1, 4096]");
        }
        if self.interval_ms == 0 || self.max_sources == 0 {
            return Err("cardinality interval_ms and max_sources must be at least 1");
        }
        Ok(())
    }
}

/// Where pre-authentication requests come from: a keyed hash of a coarse address prefix.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct SourceId(String);

impl SourceId {
    /// The source of a client `address` (text): the keyed hash of its prefix at `prefixes`. A value
    /// that is not an address is hashed as it is.
    pub fn for_address(pepper: &Pepper, address: &str, prefixes: IpPrefixes) -> Self {
        Self(keys::principal_hash(pepper, PrincipalType::Ip, address, prefixes).to_string())
    }

    /// A source named by the caller (for example a hash computed elsewhere).
    pub fn from_hash(hash: &str) -> Self {
        Self(hash.to_owned())
    }

    /// The source's text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// A refused request: the source is at its cap, or the table is full of live sources.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CardinalityRefusal {
    /// When the source's window (or, table full, the oldest window) ends, in ms from now.
    pub retry_ms: u64,
}

#[derive(Debug)]
struct Window {
    started_at_ms: u64,
    /// Hashes of the distinct keys seen in this window, at most the cap.
    keys: Vec<u64>,
}

/// The per-source windows. See the module docs.
#[derive(Debug)]
pub(crate) struct CardinalityGuard {
    config: CardinalityConfig,
    windows: Mutex<BoundedMap<String, Window>>,
}

impl CardinalityGuard {
    pub(crate) fn new(config: CardinalityConfig) -> Self {
        Self {
            config,
            windows: Mutex::new(BoundedMap::new(config.max_sources)),
        }
    }

    fn lock(&self) -> MutexGuard<'_, BoundedMap<String, Window>> {
        self.windows.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether [`admit`](Self::admit) would count `keys` against `source` at `now_ms`, counting
    /// nothing (a dry run's check).
    pub(crate) fn would_admit(
        &self,
        source: &str,
        keys: &[&str],
        now_ms: u64,
    ) -> Result<(), CardinalityRefusal> {
        let interval_ms = self.config.interval_ms;
        let windows = self.lock();
        let live = |window: &&Window| now_ms < window.started_at_ms.saturating_add(interval_ms);
        let Some(window) = windows.get(&source.to_owned()).filter(live) else {
            // A new window: refused only when the table is full of live ones.
            return match windows.oldest() {
                Some((_, oldest)) if windows.is_full() && live(&oldest) => {
                    Err(CardinalityRefusal {
                        retry_ms: (oldest.started_at_ms + interval_ms)
                            .saturating_sub(now_ms)
                            .max(1),
                    })
                }
                _ => Ok(()),
            };
        };
        self.fresh_within_cap(window, keys, now_ms).map(drop)
    }

    /// The hashes of `keys` that `window` has not counted yet, or the refusal when counting them
    /// would pass the cap.
    fn fresh_within_cap(
        &self,
        window: &Window,
        keys: &[&str],
        now_ms: u64,
    ) -> Result<Vec<u64>, CardinalityRefusal> {
        let mut fresh: Vec<u64> = keys.iter().map(|key| fnv1a(key.as_bytes())).collect();
        fresh.sort_unstable();
        fresh.dedup();
        fresh.retain(|hash| !window.keys.contains(hash));
        if window.keys.len() + fresh.len() > self.config.max_keys_per_source as usize {
            return Err(CardinalityRefusal {
                retry_ms: (window.started_at_ms + self.config.interval_ms)
                    .saturating_sub(now_ms)
                    .max(1),
            });
        }
        Ok(fresh)
    }

    /// Counts `keys` against `source` at `now_ms` (monotonic), or refuses them all.
    pub(crate) fn admit(
        &self,
        source: &str,
        keys: &[&str],
        now_ms: u64,
    ) -> Result<(), CardinalityRefusal> {
        let interval_ms = self.config.interval_ms;
        let mut windows = self.lock();
        let source = source.to_owned();
        let ended = |window: &Window| now_ms >= window.started_at_ms.saturating_add(interval_ms);
        if windows.get(&source).is_some_and(ended) {
            windows.remove(&source);
        }
        if windows.get(&source).is_none() {
            if windows.is_full() {
                match windows.oldest() {
                    Some((_, oldest)) if ended(oldest) => {
                        windows.pop_oldest();
                    }
                    Some((_, oldest)) => {
                        let retry_ms = (oldest.started_at_ms + interval_ms).saturating_sub(now_ms);
                        return Err(CardinalityRefusal {
                            retry_ms: retry_ms.max(1),
                        });
                    }
                    None => {}
                }
            }
            let window = Window {
                started_at_ms: now_ms,
                keys: Vec::new(),
            };
            // Stamped now: the table's oldest entry is the window that started first.
            if windows.insert(source.clone(), window).is_err() {
                return Err(CardinalityRefusal { retry_ms: 1 });
            }
        }
        let fresh = match windows.get(&source) {
            Some(window) => self.fresh_within_cap(window, keys, now_ms)?,
            None => return Err(CardinalityRefusal { retry_ms: 1 }),
        };
        let Some(window) = windows.get_mut(&source) else {
            return Err(CardinalityRefusal { retry_ms: 1 });
        };
        window.keys.extend(fresh);
        debug_assert!(window.keys.len() <= self.config.max_keys_per_source as usize);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard(max_keys_per_source: u32, max_sources: usize) -> CardinalityGuard {
        CardinalityGuard::new(CardinalityConfig {
            max_keys_per_source,
            interval_ms: 1_000,
            max_sources,
        })
    }

    #[test]
    fn a_source_gets_its_cap_of_distinct_keys_per_window_and_reuse_is_free() {
        let guard = guard(3, 10);
        for key in ["k1", "k2", "k3"] {
            guard.admit("s", &[key], 100).expect("under the cap");
        }
        guard
            .admit("s", &["k2"], 200)
            .expect("a key it already has");
        assert_eq!(
            guard.admit("s", &["k4"], 300),
            Err(CardinalityRefusal { retry_ms: 800 })
        );
        guard.admit("other", &["k4"], 300).expect("another source");
        guard
            .admit("s", &["k4"], 1_100)
            .expect("a new window at 100 + 1,000");
    }

    #[test]
    fn a_request_with_several_new_keys_is_counted_whole_or_refused_whole() {
        let guard = guard(3, 10);
        guard.admit("s", &["a", "b"], 0).expect("two of three");
        assert!(
            guard.admit("s", &["c", "d"], 0).is_err(),
            "four would pass the cap"
        );
        guard
            .admit("s", &["c", "c"], 0)
            .expect("nothing was counted for the refusal");
    }

    #[test]
    fn a_full_table_drops_ended_windows_and_otherwise_refuses_new_sources() {
        let guard = guard(3, 2);
        guard.admit("a", &["k"], 0).expect("room");
        guard.admit("b", &["k"], 500).expect("room");
        assert_eq!(
            guard.admit("c", &["k"], 900),
            Err(CardinalityRefusal { retry_ms: 100 }),
            "both windows live: a new source waits for the first to end"
        );
        guard
            .admit("a", &["k2"], 950)
            .expect("a known source is served");
        guard.admit("c", &["k"], 1_000).expect("a's window ended");
        assert!(
            guard.admit("a", &["k"], 1_000).is_err(),
            "a was dropped, b and c live"
        );
    }

    #[test]
    fn sources_group_addresses_by_the_coarse_prefix() {
        let pepper = Pepper::new(b"test-pepper-0123456789".to_vec()).expect("pepper");
        let source =
            |address: &str| SourceId::for_address(&pepper, address, DEFAULT_SOURCE_PREFIXES);
        assert_eq!(source("203.0.113.9"), source("203.0.113.200"));
        assert_ne!(source("203.0.113.9"), source("203.0.114.9"));
        assert_eq!(source("2001:db8:1:2::1"), source("2001:db8:1:ffff::1"));
        assert!(CardinalityConfig::default().validate().is_ok());
        assert!(
            CardinalityConfig {
                max_keys_per_source: 0,
                ..CardinalityConfig::default()
            }
            .validate()
            .is_err()
        );
    }
}

//! The store key model and keyed principal hashes.
//!
//! `rl:v<stateVersion>:{t:<tenant>}:<principalType>:<principalHash>:<routeGroup>:<stateShape>`
//! - `rl` keeps limiter keys apart from anything else in the store;
//! - `v<stateVersion>` names the state shape (fields and units), bumped only when that changes, never
//!   when a limit changes (limits travel as script arguments and stored tokens are clamped);
//! - `{t:<tenant>}` is the Redis Cluster hash tag: every key of one tenant shares one slot, so one script
//!   can decide all of a request's rules atomically (I2);
//! - the principal part is `u`/`k`/`ip` and the first 16 hex characters of
//!   HMAC-SHA256(pepper, identity), or `tenant` and the tenant id for tenant-wide keys. Raw user ids, API
//!   keys and addresses never appear in a key;
//! - the route group, or `*` for a rule that spans all route groups;
//! - the shape of the state the rule's algorithm stores (`tb`, `gcra`, `fw`, `sc`, `sl`): a rule
//!   whose algorithm changes (or an exemption with another algorithm over the same key) starts from
//!   fresh state under a new key, and the old key simply expires.
//!
//! [`principal_key`] and [`tenant_key`] build the rule's key without its state shape (what the
//! rule's concurrency set, [`concurrency_key`], is named after: slots do not depend on the rate
//! algorithm); [`rule_state_key`] adds the shape.
//!
//! Every segment is built from validated identifiers whose charsets exclude `{`, `}` and `:`, so no
//! input can shape another tenant's key.

use std::fmt;
use std::net::IpAddr;

use hmac::{Hmac, KeyInit, Mac};
use sha2::Sha256;

use crate::contract::PrincipalType;
use crate::ids::{DecisionId, RouteGroup, TenantId};

/// The current state-shape version: token buckets in millitokens and epoch ms.
pub const STATE_VERSION: u32 = 1;

/// Shortest accepted pepper, in bytes.
pub const MIN_PEPPER_LEN: usize = 16;

/// The secret key of principal hashes. Its `Debug` never shows the bytes.
#[derive(Clone)]
pub struct Pepper(Vec<u8>);

/// A pepper that is too short to be a secret.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the HMAC pepper must be at least {MIN_PEPPER_LEN} bytes, got {0}")]
pub struct PepperTooShort(pub usize);

impl Pepper {
    /// Wraps secret bytes (at least [`MIN_PEPPER_LEN`]).
    pub fn new(bytes: Vec<u8>) -> Result<Self, PepperTooShort> {
        if bytes.len() < MIN_PEPPER_LEN {
            return Err(PepperTooShort(bytes.len()));
        }
        Ok(Self(bytes))
    }
}

impl Pepper {
    /// A non-secret fingerprint of the pepper: the first 4 bytes of SHA-256 over a fixed label and
    /// the pepper, in hex. Agents of one region must share one pepper (two peppers split every
    /// principal's buckets in two); the fingerprint lets operators see that they do without the
    /// pepper leaving the agent. 32 bits of a hash of at least 128 secret bits reveal nothing usable.
    pub fn fingerprint(&self) -> String {
        use sha2::Digest;
        let mut hasher = Sha256::new();
        hasher.update(b"allot-pepper-fingerprint:");
        hasher.update(&self.0);
        hex::encode(&hasher.finalize()[..4])
    }
}

impl fmt::Debug for Pepper {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Pepper(<redacted>)")
    }
}

/// Prefix lengths used to key anonymous (IP) principals: the HMAC input is the prefix, not the
/// address, so one host cannot mint fresh buckets by rotating through addresses it controls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IpPrefixes {
    /// Prefix length for IPv4, 1 to 32 (default 32).
    pub v4_bits: u8,
    /// Prefix length for IPv6, 1 to 128 (default 64).
    pub v6_bits: u8,
}

impl Default for IpPrefixes {
    fn default() -> Self {
        Self {
            v4_bits: 32,
            v6_bits: 64,
        }
    }
}

/// A rule's own prefix lengths for anonymous principals (`ipPrefixV4`, `ipPrefixV6`), each `None`
/// to keep the agent's. A rule with its own lengths keys its buckets apart from rules keyed at the
/// agent's ([`RulePrefixes::key_segment`]), so a second rule over a broader prefix is a ceiling
/// over the narrow one, not the same bucket.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct RulePrefixes {
    /// IPv4 prefix length, 1 to 32.
    pub v4_bits: Option<u8>,
    /// IPv6 prefix length, 1 to 128.
    pub v6_bits: Option<u8>,
}

impl RulePrefixes {
    /// The lengths in force for this rule on an agent keying at `agent`.
    pub fn resolve(self, agent: IpPrefixes) -> IpPrefixes {
        IpPrefixes {
            v4_bits: self.v4_bits.unwrap_or(agent.v4_bits),
            v6_bits: self.v6_bits.unwrap_or(agent.v6_bits),
        }
    }

    /// The principal segment of this rule's keys: `ipp<v4>-<v6>`, 0 for a length left to the agent
    /// (never `ip`, the segment of rules keyed at the agent's lengths).
    pub fn key_segment(self) -> String {
        format!(
            "ipp{}-{}",
            self.v4_bits.unwrap_or(0),
            self.v6_bits.unwrap_or(0)
        )
    }
}

/// The canonical `address/bits` text of the prefix of `addr`.
pub fn ip_prefix(addr: IpAddr, prefixes: IpPrefixes) -> String {
    match addr {
        IpAddr::V4(v4) => {
            let bits = u32::from(prefixes.v4_bits.clamp(1, 32));
            let mask = u32::MAX << (32 - bits);
            let net = std::net::Ipv4Addr::from(u32::from(v4) & mask);
            format!("{net}/{bits}")
        }
        IpAddr::V6(v6) => {
            let bits = u32::from(prefixes.v6_bits.clamp(1, 128));
            let mask = u128::MAX << (128 - bits);
            let net = std::net::Ipv6Addr::from(u128::from(v6) & mask);
            format!("{net}/{bits}")
        }
    }
}

/// The 16-hex-character keyed hash of a principal.
#[derive(
    Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(try_from = "String", into = "String")]
pub struct PrincipalHash(String);

/// The hash's text pattern, as the OpenAPI documents' `pattern`.
pub const PRINCIPAL_HASH_PATTERN: &str = "^[0-9a-f]{16}$";

impl PrincipalHash {
    /// The hash text.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// Reads a hash written as [`principal_hash`] writes it: 16 lowercase hex digits.
    pub fn parse(text: &str) -> Result<Self, String> {
        if text.len() == 16 && text.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
            Ok(Self(text.to_owned()))
        } else {
            Err(format!(
                "a principal hash is 16 lowercase hex digits, got {:?}",
                text.chars().take(32).collect::<String>()
            ))
        }
    }
}

impl TryFrom<String> for PrincipalHash {
    type Error = String;
    fn try_from(text: String) -> Result<Self, String> {
        Self::parse(&text)
    }
}

impl From<PrincipalHash> for String {
    fn from(hash: PrincipalHash) -> String {
        hash.0
    }
}

impl utoipa::PartialSchema for PrincipalHash {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .pattern(Some(PRINCIPAL_HASH_PATTERN))
            .into()
    }
}

impl utoipa::ToSchema for PrincipalHash {}

impl fmt::Display for PrincipalHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Hashes a principal: `hex(HMAC-SHA256(pepper, "<type>:<identity>"))[..16]`. For `ip` principals the
/// identity is the configured prefix of the address when `id` parses as one.
pub fn principal_hash(
    pepper: &Pepper,
    kind: PrincipalType,
    id: &str,
    prefixes: IpPrefixes,
) -> PrincipalHash {
    let identity = match (kind, id.parse::<IpAddr>()) {
        (PrincipalType::Ip, Ok(addr)) => ip_prefix(addr, prefixes),
        _ => id.to_owned(),
    };
    let mut mac = match <Hmac<Sha256> as KeyInit>::new_from_slice(&pepper.0) {
        Ok(mac) => mac,
        // HMAC accepts keys of any length; this arm cannot be reached.
        Err(_) => return PrincipalHash(String::from("0000000000000000")),
    };
    mac.update(kind.key_segment().as_bytes());
    mac.update(b":");
    mac.update(identity.as_bytes());
    let digest = mac.finalize().into_bytes();
    PrincipalHash(hex::encode(&digest[..8]))
}

/// The route-group segment of a key: the group, or `*` for all groups.
pub fn route_segment(route_group: Option<&RouteGroup>) -> &str {
    route_group.map_or("*", RouteGroup::as_str)
}

/// The hash tag of a tenant's keys, `{t:<tenant>}`.
pub fn hash_tag(tenant: &TenantId) -> String {
    let mut tag = String::with_capacity(tenant.as_str().len() + 4);
    push_tag(&mut tag, tenant);
    tag
}

/// Appends `tenant`'s hash tag to `key`.
fn push_tag(key: &mut String, tenant: &TenantId) {
    key.push_str("{t:");
    key.push_str(tenant.as_str());
    key.push('}');
}

/// What every key of a rule's state begins with: `rl:v<STATE_VERSION>:`.
const KEY_PREFIX: &str = "rl:v1:";

/// A key of `tenant`'s: [`KEY_PREFIX`], its hash tag, then `segments`, one `:` apart. Every
/// decision builds several, so each is built in one allocation, without the formatting
/// machinery: a request of three rules and its record built its keys in 590 ns with `format!`,
/// 104 ns so (the decisions bench, `request keys`).
fn tenant_scoped_key(tenant: &TenantId, segments: &[&str]) -> String {
    let length = KEY_PREFIX.len()
        + tenant.as_str().len()
        + 4
        + segments
            .iter()
            .map(|segment| segment.len() + 1)
            .sum::<usize>();
    let mut key = String::with_capacity(length);
    key.push_str(KEY_PREFIX);
    push_tag(&mut key, tenant);
    for segment in segments {
        key.push(':');
        key.push_str(segment);
    }
    debug_assert_eq!(key.len(), length);
    key
}

/// The hash tag of sub-slot `index` of a hot `tenant`, `{t:<tenant>:<index>}`: a hot tenant's
/// keys are spread over several tags (slots), each holding a part of its tenant-wide budgets.
pub fn sub_slot_tag(tenant: &TenantId, index: u32) -> String {
    format!("{{t:{tenant}:{index}}}")
}

/// `key` (built by this module, so carrying exactly one tag, `tenant`'s) moved into sub-slot
/// `index` of `tenant`: the same key under [`sub_slot_tag`]. `None` when the key does not carry
/// exactly one `{t:<tenant>}` tag.
pub fn sub_slot_key(key: &str, tenant: &TenantId, index: u32) -> Option<String> {
    let tag = hash_tag(tenant);
    if key.matches('{').count() != 1 || key.matches('}').count() != 1 {
        return None;
    }
    let start = key.find(&tag)?;
    let end = start + tag.len();
    Some(format!(
        "{}{}{}",
        &key[..start],
        sub_slot_tag(tenant, index),
        &key[end..]
    ))
}

/// The key of a per-principal rule.
pub fn principal_key(
    tenant: &TenantId,
    kind: PrincipalType,
    hash: &PrincipalHash,
    route_group: Option<&RouteGroup>,
) -> String {
    principal_key_in(tenant, kind.key_segment(), hash, route_group)
}

/// The key of a per-principal rule whose principal segment is `segment` (a type's, or a rule's own
/// prefix lengths': [`RulePrefixes::key_segment`]).
pub fn principal_key_in(
    tenant: &TenantId,
    segment: &str,
    hash: &PrincipalHash,
    route_group: Option<&RouteGroup>,
) -> String {
    tenant_scoped_key(
        tenant,
        &[segment, hash.as_str(), route_segment(route_group)],
    )
}

/// The key of a tenant-wide rule (`route_group = None`) or of a tenant's route budget.
pub fn tenant_key(tenant: &TenantId, route_group: Option<&RouteGroup>) -> String {
    tenant_scoped_key(
        tenant,
        &["tenant", tenant.as_str(), route_segment(route_group)],
    )
}

/// The key a rule's state is stored under: its key (from [`principal_key`] or [`tenant_key`]) and
/// the shape of the state its algorithm stores (`Algorithm::state_shape`).
pub fn rule_state_key(rule_key: &str, state_shape: &str) -> String {
    debug_assert!(!state_shape.contains(':'));
    let mut key = String::with_capacity(rule_key.len() + 1 + state_shape.len());
    key.push_str(rule_key);
    key.push(':');
    key.push_str(state_shape);
    key
}

/// The concurrency-lease set that belongs to a rule: named after the rule's key without its state
/// shape (`rule_state_key` adds one `:<shape>` segment, taken off here), so changing the rate
/// algorithm keeps the slots held.
pub fn concurrency_key(rule_state_key: &str) -> String {
    let rule_key = rule_state_key
        .rsplit_once(':')
        .map_or(rule_state_key, |(rule_key, _shape)| rule_key);
    format!("{rule_key}:cc")
}

/// The idempotency record of a decision, under the tenant's tag so it shares the rules' slot.
pub fn decision_key(tenant: &TenantId, decision_id: &DecisionId) -> String {
    tenant_scoped_key(tenant, &["d", decision_id.as_str()])
}

/// The hash tag a key belongs to (the text between the first `{` and the next `}`), as Redis Cluster
/// computes slots.
pub fn key_hash_tag(key: &str) -> Option<&str> {
    let open = key.find('{')?;
    let close = key[open + 1..].find('}')? + open + 1;
    (close > open + 1).then(|| &key[open + 1..close])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pepper() -> Pepper {
        Pepper::new(b"test-pepper-0123456789".to_vec()).expect("long enough")
    }

    fn tenant(t: &str) -> TenantId {
        TenantId::parse(t).expect("tenant")
    }

    /// The prefix the keys are built with is the state version's.
    #[test]
    fn the_key_prefix_names_the_state_version() {
        assert_eq!(KEY_PREFIX, format!("rl:v{STATE_VERSION}:"));
    }

    #[test]
    fn keys_follow_the_model() {
        let read = RouteGroup::parse("read").expect("route");
        let hash = principal_hash(
            &pepper(),
            PrincipalType::User,
            "U-17",
            IpPrefixes::default(),
        );
        assert_eq!(hash.as_str().len(), 16);
        assert!(hash.as_str().bytes().all(|b| b.is_ascii_hexdigit()));
        let key = principal_key(&tenant("atlas"), PrincipalType::User, &hash, Some(&read));
        assert_eq!(key, format!("rl:v1:{{t:atlas}}:u:{hash}:read"));
        assert_eq!(
            tenant_key(&tenant("atlas"), None),
            "rl:v1:{t:atlas}:tenant:atlas:*"
        );
        assert_eq!(key_hash_tag(&key), Some("t:atlas"));
        assert_eq!(
            key_hash_tag(&tenant_key(&tenant("atlas"), None)),
            Some("t:atlas")
        );
        let d = DecisionId::parse("r-e41").expect("decision");
        assert_eq!(
            decision_key(&tenant("atlas"), &d),
            "rl:v1:{t:atlas}:d:r-e41"
        );
    }

    #[test]
    fn raw_identities_never_appear_in_keys() {
        let hash = principal_hash(
            &pepper(),
            PrincipalType::User,
            "U-17",
            IpPrefixes::default(),
        );
        let key = principal_key(&tenant("atlas"), PrincipalType::User, &hash, None);
        assert!(!key.contains("U-17"));
        let ip = principal_hash(
            &pepper(),
            PrincipalType::Ip,
            "203.0.113.9",
            IpPrefixes::default(),
        );
        assert!(!principal_key(&tenant("atlas"), PrincipalType::Ip, &ip, None).contains("203.0"));
    }

    #[test]
    fn hashes_depend_on_pepper_type_and_identity() {
        let p = IpPrefixes::default();
        let other = Pepper::new(b"another-pepper-0123456".to_vec()).expect("pepper");
        let a = principal_hash(&pepper(), PrincipalType::User, "U-17", p);
        assert_eq!(a, principal_hash(&pepper(), PrincipalType::User, "U-17", p));
        assert_ne!(a, principal_hash(&other, PrincipalType::User, "U-17", p));
        assert_ne!(
            a,
            principal_hash(&pepper(), PrincipalType::ApiKey, "U-17", p)
        );
        assert_ne!(a, principal_hash(&pepper(), PrincipalType::User, "U-18", p));
    }

    #[test]
    fn ipv6_principals_are_keyed_by_their_prefix() {
        let p = IpPrefixes::default();
        let a = principal_hash(&pepper(), PrincipalType::Ip, "2001:db8:1:2::1", p);
        let b = principal_hash(&pepper(), PrincipalType::Ip, "2001:db8:1:2:ffff::9", p);
        let c = principal_hash(&pepper(), PrincipalType::Ip, "2001:db8:1:3::1", p);
        assert_eq!(a, b, "same /64");
        assert_ne!(a, c, "different /64");
        assert_eq!(
            ip_prefix("2001:db8:1:2::1".parse().expect("ip"), p),
            "2001:db8:1:2::/64"
        );
        assert_eq!(
            ip_prefix(
                "203.0.113.9".parse().expect("ip"),
                IpPrefixes {
                    v4_bits: 24,
                    v6_bits: 64
                }
            ),
            "203.0.113.0/24"
        );
    }

    #[test]
    fn short_peppers_are_refused_and_never_printed() {
        assert_eq!(Pepper::new(vec![1; 15]).err(), Some(PepperTooShort(15)));
        assert_eq!(format!("{:?}", pepper()), "Pepper(<redacted>)");
    }

    #[test]
    fn pepper_fingerprints_are_stable_and_short() {
        let pepper = Pepper::new(b"a-pepper-of-32-bytes-0123456789ab".to_vec()).expect("pepper");
        let again = Pepper::new(b"a-pepper-of-32-bytes-0123456789ab".to_vec()).expect("pepper");
        let other = Pepper::new(b"a-pepper-of-32-bytes-0123456789ac".to_vec()).expect("pepper");
        let fingerprint = pepper.fingerprint();
        assert_eq!(fingerprint, again.fingerprint());
        assert_ne!(fingerprint, other.fingerprint());
        assert_eq!(fingerprint.len(), 8);
        assert!(fingerprint.bytes().all(|b| b.is_ascii_hexdigit()));
    }
}

//! Validated identifiers.
//!
//! Identifiers end up inside store keys, etcd paths, metric labels and log lines, so each one is parsed
//! once at the boundary into a type whose charset makes those uses safe: no identifier can contain `{`,
//! `}`, `:` or `/`, so none can shape a Redis hash tag, a key segment or an etcd path. Parsing never panics;
//! an [`IdError`] names the kind of identifier and why the value was refused.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Why a string was refused as an identifier.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// The value was empty.
    #[error("{kind} must not be empty")]
    Empty {
        /// Which identifier was being parsed, e.g. `tenant id`.
        kind: &'static str,
    },
    /// The value was longer than allowed.
    #[error("{kind} must be at most {max} characters, got {len}")]
    TooLong {
        /// Which identifier was being parsed.
        kind: &'static str,
        /// The largest allowed length in bytes (all allowed characters are ASCII).
        max: usize,
        /// The length that was given, in bytes.
        len: usize,
    },
    /// The value contained a character outside the identifier's charset.
    #[error("{kind} may only contain {charset}; found {found:?} at byte {position}")]
    BadCharacter {
        /// Which identifier was being parsed.
        kind: &'static str,
        /// A human description of the allowed charset.
        charset: &'static str,
        /// The first offending character.
        found: char,
        /// Its byte offset in the value.
        position: usize,
    },
    /// A UUID-v7 id (a lease id, a record id) that is not a version-7 UUID.
    #[error("{kind} must be a UUID v7, got {value:?}")]
    NotUuidV7 {
        /// Which identifier was being parsed.
        kind: &'static str,
        /// The value, at most its first 64 characters.
        value: String,
    },
}

fn check(
    value: &str,
    kind: &'static str,
    max: usize,
    charset: &'static str,
    allowed: fn(char) -> bool,
) -> Result<(), IdError> {
    if value.is_empty() {
        return Err(IdError::Empty { kind });
    }
    // Length first, so a hostile 10 MB value is refused without scanning it.
    if value.len() > max {
        return Err(IdError::TooLong {
            kind,
            max,
            len: value.len(),
        });
    }
    if let Some((position, found)) = value.char_indices().find(|&(_, c)| !allowed(c)) {
        return Err(IdError::BadCharacter {
            kind,
            charset,
            found,
            position,
        });
    }
    Ok(())
}

fn lower_alnum_dash(c: char) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-'
}

fn lower_alnum_dash_underscore_dot(c: char) -> bool {
    lower_alnum_dash(c) || c == '_' || c == '.'
}

fn alnum_dash_underscore_dot(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '_' || c == '.'
}

macro_rules! string_id {
    ($(#[$doc:meta])* $name:ident, $kind:literal, $max:literal, $charset:literal, $pattern:literal, $allowed:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            /// Largest allowed length, in bytes.
            pub const MAX_LEN: usize = $max;
            /// Valid values as a regular expression (the OpenAPI documents' `pattern`).
            pub const PATTERN: &'static str = $pattern;

            /// Parses and validates `value`.
            pub fn parse(value: &str) -> Result<Self, IdError> {
                check(value, $kind, $max, $charset, $allowed)?;
                Ok(Self(value.to_owned()))
            }

            /// The identifier as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl TryFrom<String> for $name {
            type Error = IdError;
            fn try_from(value: String) -> Result<Self, IdError> {
                check(&value, $kind, $max, $charset, $allowed)?;
                Ok(Self(value))
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }

        impl utoipa::PartialSchema for $name {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                utoipa::openapi::ObjectBuilder::new()
                    .schema_type(utoipa::openapi::schema::Type::String)
                    .min_length(Some(1))
                    .max_length(Some($max))
                    .pattern(Some($pattern))
                    .into()
            }
        }

        impl utoipa::ToSchema for $name {}

        impl std::str::FromStr for $name {
            type Err = IdError;
            fn from_str(value: &str) -> Result<Self, IdError> {
                Self::parse(value)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }
    };
}

string_id!(
    /// A tenant: `[a-z0-9-]{1,32}`. Sits inside the Redis hash tag `{t:<tenant>}`, so the charset is a
    /// security boundary (a `}` or `:` could otherwise shape keys).
    TenantId, "tenant id", 32, "a-z, 0-9 and '-'", "^[a-z0-9-]{1,32}$", lower_alnum_dash
);
string_id!(
    /// A tenant's quota pool at the allocator, e.g. `api`: `[a-z0-9-]{1,32}`.
    PoolId, "pool id", 32, "a-z, 0-9 and '-'", "^[a-z0-9-]{1,32}$", lower_alnum_dash
);
string_id!(
    /// A region, e.g. `eu`: `[a-z0-9-]{1,32}`.
    RegionId, "region id", 32, "a-z, 0-9 and '-'", "^[a-z0-9-]{1,32}$", lower_alnum_dash
);
string_id!(
    /// A route group, e.g. `read` or `export`: `[a-z0-9_-]{1,32}`.
    RouteGroup, "route group", 32, "a-z, 0-9, '-' and '_'", "^[a-z0-9_-]{1,32}$", |c| lower_alnum_dash(c) || c == '_'
);
string_id!(
    /// A policy rule id, e.g. `read-user-v3`: `[a-z0-9._-]{1,64}`.
    RuleId, "rule id", 64, "a-z, 0-9, '-', '_' and '.'", "^[a-z0-9._-]{1,64}$", lower_alnum_dash_underscore_dot
);
string_id!(
    /// A region agent's id, in policy status: `[A-Za-z0-9._-]{1,64}` (by default
    /// `<region>-<host name>-<listen port>`).
    AgentId, "agent id", 64, "A-Z, a-z, 0-9, '-', '_' and '.'", "^[A-Za-z0-9._-]{1,64}$", alnum_dash_underscore_dot
);
string_id!(
    /// A decision id, minted by the gateway at ingress and stable across retries (the idempotency scope):
    /// `[A-Za-z0-9._-]{1,64}`. It names idempotency records and sliding-log members in the store.
    DecisionId, "decision id", 64, "A-Z, a-z, 0-9, '-', '_' and '.'", "^[A-Za-z0-9._-]{1,64}$", alnum_dash_underscore_dot
);

/// A hyphenated version-7 UUID, as the OpenAPI documents' `pattern`.
pub const UUID_V7_PATTERN: &str =
    "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-7[0-9a-fA-F]{3}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$";

macro_rules! uuid_v7_id {
    ($(#[$doc:meta])* $name:ident, $kind:literal) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(uuid::Uuid);

        impl $name {
            /// Parses a hyphenated UUID and checks that it is version 7.
            pub fn parse(value: &str) -> Result<Self, IdError> {
                match uuid::Uuid::try_parse(value) {
                    Ok(id) if id.get_version_num() == 7 => Ok(Self(id)),
                    _ => Err(IdError::NotUuidV7 {
                        kind: $kind,
                        value: value.chars().take(64).collect(),
                    }),
                }
            }

            /// Builds the id from its parts: a timestamp in epoch ms and 74 bits of randomness
            /// supplied by the caller (this crate has no random source and no clock).
            pub fn from_parts(unix_ms: u64, random: u128) -> Self {
                let bytes = random.to_be_bytes();
                let mut rand_bytes = [0u8; 10];
                rand_bytes.copy_from_slice(&bytes[6..16]);
                Self(uuid::Builder::from_unix_timestamp_millis(unix_ms, &rand_bytes).into_uuid())
            }

            /// The underlying UUID.
            pub fn as_uuid(&self) -> uuid::Uuid {
                self.0
            }

            /// When it was made, epoch ms: its UUID v7 timestamp, on the maker's clock.
            pub fn unix_ms(&self) -> u64 {
                self.0.get_timestamp().map_or(0, |at| {
                    let (secs, nanos) = at.to_unix();
                    secs.saturating_mul(1_000)
                        .saturating_add(u64::from(nanos) / 1_000_000)
                })
            }
        }

        impl TryFrom<String> for $name {
            type Error = IdError;
            fn try_from(value: String) -> Result<Self, IdError> {
                Self::parse(&value)
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0.hyphenated().to_string()
            }
        }

        impl utoipa::PartialSchema for $name {
            fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
                utoipa::openapi::ObjectBuilder::new()
                    .schema_type(utoipa::openapi::schema::Type::String)
                    .format(Some(utoipa::openapi::SchemaFormat::Custom(
                        "uuid".to_owned(),
                    )))
                    .pattern(Some(UUID_V7_PATTERN))
                    .into()
            }
        }

        impl utoipa::ToSchema for $name {}

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Display::fmt(&self.0.hyphenated(), f)
            }
        }
    };
}

uuid_v7_id!(
    /// A lease id: a UUID v7 chosen by the agent, which makes a grant request idempotent (a retry
    /// with the same id returns the stored answer and grants nothing new).
    LeaseId,
    "lease id"
);
uuid_v7_id!(
    /// One run of an agent process, minted when it starts: the allocator tells one run of an
    /// agent from the next by it (a crash leaves a run that never said it ended).
    AgentIncarnation,
    "agent incarnation"
);
uuid_v7_id!(
    /// The id of a record that is not a lease: a report (its idempotency key), a pool change, an
    /// audit entry. A UUID v7, so records sort by when they were made.
    RecordId,
    "record id"
);

/// An allocator leadership epoch: strictly increasing across leadership changes and stamped on every
/// grant. An agent ignores any grant whose epoch is below the highest it has seen, which fences off a
/// deposed allocator.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Default,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
#[serde(transparent)]
pub struct Epoch(pub u64);

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// An id that names what a record is about: the first 128 bits of a SHA-256 over `fields`, one
/// per line, in hex. The same fields always give the same id, so a consumer loading a record twice
/// (a usage export, a webhook event found again) sees one record.
pub fn content_id(fields: &[&dyn fmt::Display]) -> String {
    use sha2::{Digest, Sha256};
    let text = fields
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n");
    hex::encode(&Sha256::digest(text)[..16])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_content_id_is_the_first_128_bits_of_a_sha256_of_its_fields_one_per_line() {
        // sha256("acme\napi\neu\n60000"), computed apart.
        assert_eq!(
            content_id(&[&"acme", &"api", &"eu", &60_000u64]),
            "76c2d9854dd65de4ad4a5c519c560852"
        );
        assert_ne!(content_id(&[&"a\nb"]), content_id(&[&"a", &"b\n"]));
    }

    #[test]
    fn tenant_ids_follow_the_charset() {
        assert!(TenantId::parse("atlas").is_ok());
        assert!(TenantId::parse("birch-2").is_ok());
        assert!(TenantId::parse(&"a".repeat(32)).is_ok());
        assert_eq!(
            TenantId::parse(&"a".repeat(33)),
            Err(IdError::TooLong {
                kind: "tenant id",
                max: 32,
                len: 33
            })
        );
        assert_eq!(
            TenantId::parse(""),
            Err(IdError::Empty { kind: "tenant id" })
        );
        for hostile in [
            "at}las", "at:las", "Atlas", "atlas ", "at{las", "a/b", "ätlas",
        ] {
            let err = TenantId::parse(hostile).expect_err(hostile);
            assert!(
                matches!(err, IdError::BadCharacter { .. }),
                "{hostile}: {err}"
            );
        }
    }

    #[test]
    fn error_messages_name_the_identifier_and_the_character() {
        let err = TenantId::parse("at}las").expect_err("brace");
        assert_eq!(
            err.to_string(),
            "tenant id may only contain a-z, 0-9 and '-'; found '}' at byte 2"
        );
    }

    #[test]
    fn ids_deserialize_through_validation() {
        let ok: TenantId = serde_json::from_str("\"atlas\"").expect("valid");
        assert_eq!(ok.as_str(), "atlas");
        let err = serde_json::from_str::<TenantId>("\"{t:x}\"").expect_err("invalid");
        assert!(err.to_string().contains("tenant id may only contain"));
    }

    #[test]
    fn lease_ids_must_be_uuid_v7() {
        let id = LeaseId::from_parts(1_700_000_000_000, 0x1234_5678_9abc_def0_1234);
        let text = id.to_string();
        assert_eq!(LeaseId::parse(&text), Ok(id));
        // A v4 UUID is refused.
        assert!(LeaseId::parse("9f3a61c2-e07b-4d18-8a2b-0c1d2e3f4a5b").is_err());
        assert!(LeaseId::parse("not-a-uuid").is_err());
        let json = serde_json::to_string(&id).expect("serialize");
        assert_eq!(json, format!("\"{text}\""));
    }

    #[test]
    fn decision_ids_allow_gateway_request_ids() {
        assert!(DecisionId::parse("r-9f3a61c2e07b4d18").is_ok());
        assert!(DecisionId::parse("r-e41").is_ok());
        assert!(DecisionId::parse("r:1").is_err());
        assert!(DecisionId::parse(&"x".repeat(65)).is_err());
    }
}

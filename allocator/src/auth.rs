//! Who may call the allocator, and as what.
//!
//! Every API call carries a bearer token. A token is known only by its SHA-256 digest: the allocator
//! never keeps a token it did not just mint, and a token file may hold digests (`sha256:<hex>`)
//! instead of tokens. A token belongs to one holder:
//! - an operator with a role: `viewer` reads, `author` also changes pools and publishes policies,
//!   `admin` also manages tokens (each role includes the ones before it);
//! - an agent, scoped to one region (an agent for `eu` cannot take grants or report for `us`), or to
//!   every region when its file line names none (accepted for compatibility, warned about at start).
//!
//! Tokens come from two places: the token files given at start (fixed for the process's life) and
//! tokens minted through the API by an admin, kept in the store as digests under `/allot/tokens/` and
//! re-read by every allocator every [`TOKEN_REFRESH_INTERVAL`], so a revocation takes effect
//! everywhere within that interval.
//!
//! Lookups hash the presented token and look the digest up: the time taken does not depend on how
//! much of a stored token a guess matches (an attacker cannot steer a SHA-256 digest).

use std::collections::HashMap;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use allot_shared::ids::RegionId;
use arc_swap::ArcSwap;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::kv::{Compare, Kv, KvError, Op};

/// Shortest accepted bearer token, in characters.
pub const MIN_TOKEN_LEN: usize = 16;
/// Longest accepted bearer token, in characters (I10).
pub const MAX_TOKEN_LEN: usize = 256;
/// Most tokens the store may hold (I10); minting more is refused.
pub const MAX_STORED_TOKENS: usize = 1_000;
/// Longest token name, in characters.
pub const MAX_TOKEN_NAME_LEN: usize = 64;
/// How often an allocator re-reads the stored tokens (revocations take effect within this).
pub const TOKEN_REFRESH_INTERVAL: Duration = Duration::from_secs(2);
/// Prefix of minted tokens, so a leaked one is recognisable by secret scanners.
pub const MINTED_TOKEN_PREFIX: &str = "allot_";

/// Key prefix of stored (minted) tokens.
pub const TOKEN_PREFIX: &str = "/allot/tokens/";

/// What an operator token may do. Each role includes the ones before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OperatorRole {
    /// Reads pools, windows, policies, the audit log.
    Viewer,
    /// Also configures pools and publishes, promotes and rolls back policies.
    Author,
    /// Also mints and revokes tokens.
    Admin,
}

impl OperatorRole {
    /// Parses `viewer`, `author` or `admin`.
    pub fn parse(text: &str) -> Option<Self> {
        match text {
            "viewer" => Some(Self::Viewer),
            "author" => Some(Self::Author),
            "admin" => Some(Self::Admin),
            _ => None,
        }
    }

    /// The role's name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Viewer => "viewer",
            Self::Author => "author",
            Self::Admin => "admin",
        }
    }
}

/// Who holds a token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holder {
    /// An operator with a role.
    Operator(OperatorRole),
    /// A region agent; `None` = any region (an unscoped file token).
    Agent(Option<RegionId>),
}

impl Holder {
    /// The holder's kind as the API names it: a role, or `agent`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Operator(role) => role.as_str(),
            Self::Agent(_) => "agent",
        }
    }
}

/// An authenticated caller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Credential {
    /// The token's id: `file-<8 hex of its digest>` for file tokens, `tok-<hex>` for minted ones.
    /// Safe to log; never the token.
    pub id: String,
    /// Who holds it.
    pub holder: Holder,
}

impl Credential {
    /// How the audit log names this caller: `<kind>:<id>`.
    pub fn actor(&self) -> String {
        format!("{}:{}", self.holder.kind(), self.id)
    }

    /// Whether this caller may act for `region` (agents are scoped; operators are not agents).
    pub fn may_act_for(&self, region: &RegionId) -> bool {
        match &self.holder {
            Holder::Agent(None) => true,
            Holder::Agent(Some(scope)) => scope == region,
            Holder::Operator(_) => false,
        }
    }
}

/// The id of a minted token, `tok-<16 hex>`: minted here, parsed here (the API's revoke path).
/// Safe to log; never the token.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TokenId(String);

/// A token id that is not `tok-<16 hex>`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TokenIdError {
    /// A token file's id (`file-<hex>`): such a token is revoked by removing its line.
    #[error("this token comes from a token file: remove its line and restart the allocator")]
    FromFile,
    /// Not of the form.
    #[error("must be tok- and 16 hex digits")]
    Malformed,
}

impl TokenId {
    /// A fresh id.
    fn mint() -> Self {
        Self(format!("tok-{}", hex::encode(rand::random::<[u8; 8]>())))
    }

    /// Parses a minted token's id.
    pub fn parse(text: &str) -> Result<Self, TokenIdError> {
        if text.starts_with("file-") {
            return Err(TokenIdError::FromFile);
        }
        let well_formed = text
            .strip_prefix("tok-")
            .is_some_and(|hex| hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit()));
        if !well_formed {
            return Err(TokenIdError::Malformed);
        }
        Ok(Self(text.to_owned()))
    }

    /// The id as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for TokenId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A token's SHA-256 digest.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct TokenDigest([u8; 32]);

impl TokenDigest {
    /// The digest of `token`.
    pub fn of(token: &str) -> Self {
        Self(Sha256::digest(token.as_bytes()).into())
    }

    /// Parses `sha256:<64 hex>`.
    pub fn parse(text: &str) -> Option<Self> {
        let hex_part = text.strip_prefix("sha256:")?;
        let mut bytes = [0u8; 32];
        hex::decode_to_slice(hex_part, &mut bytes).ok()?;
        Some(Self(bytes))
    }

    fn file_id(&self) -> String {
        format!("file-{}", hex::encode(&self.0[..4]))
    }
}

impl fmt::Display for TokenDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sha256:{}", hex::encode(self.0))
    }
}

impl fmt::Debug for TokenDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TokenDigest({})", self.file_id())
    }
}

/// The token lines of the two token files, as read (validated by [`TokenBook::from_files`]).
///
/// Operator file line: `[admin|author|viewer] <token or sha256:hex>` (no role = `admin`).
/// Agent file line: `[<region>|*] <token or sha256:hex>` (no region = any region, warned about).
/// Blank lines and `#` comments are skipped.
#[derive(Clone, Default)]
pub struct Tokens {
    /// Lines of the operator token file.
    pub operator: Vec<String>,
    /// Lines of the agent token file.
    pub agent: Vec<String>,
}

impl fmt::Debug for Tokens {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Tokens {{ operator: {} line(s), agent: {} line(s) }}",
            self.operator.len(),
            self.agent.len()
        )
    }
}

/// Checks a token's shape: what every presented and filed token must be.
pub fn check_token_shape(token: &str) -> Result<(), String> {
    if token.len() < MIN_TOKEN_LEN {
        return Err(format!("shorter than {MIN_TOKEN_LEN} characters"));
    }
    if token.len() > MAX_TOKEN_LEN {
        return Err(format!("longer than {MAX_TOKEN_LEN} characters"));
    }
    if !token.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("not printable ASCII without spaces".to_owned());
    }
    Ok(())
}

fn digest_of_field(field: &str) -> Result<TokenDigest, String> {
    if field.starts_with("sha256:") {
        return TokenDigest::parse(field)
            .ok_or_else(|| "a digest must be sha256: and 64 hex digits".to_owned());
    }
    check_token_shape(field)?;
    Ok(TokenDigest::of(field))
}

/// One line of a token file: `Ok(None)` for blank lines and comments.
fn parse_line(
    line: &str,
    scope: impl Fn(&str) -> Result<Holder, String>,
    bare: &Holder,
) -> Result<Option<(TokenDigest, Holder)>, String> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return Ok(None);
    }
    let fields: Vec<&str> = line.split_whitespace().collect();
    match fields.as_slice() {
        [token] => Ok(Some((digest_of_field(token)?, bare.clone()))),
        [qualifier, token] => Ok(Some((digest_of_field(token)?, scope(qualifier)?))),
        _ => Err("expected `[role or region] <token>`".to_owned()),
    }
}

/// Every token the allocator accepts: the files' (fixed) and the store's (refreshed).
pub struct TokenBook {
    files: HashMap<TokenDigest, Credential>,
    stored: ArcSwap<HashMap<TokenDigest, Credential>>,
    /// Agent file lines that name no region (any region): worth a warning.
    pub unscoped_agent_tokens: usize,
}

impl fmt::Debug for TokenBook {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "TokenBook {{ files: {}, stored: {} }}",
            self.files.len(),
            self.stored.load().len()
        )
    }
}

impl TokenBook {
    /// Reads the file lines, naming the file and line of the first bad one. Both files must hold at
    /// least one token.
    pub fn from_files(tokens: &Tokens) -> Result<Self, String> {
        let mut files = HashMap::new();
        let mut unscoped_agent_tokens = 0;
        let files_and_scopes: [(&str, &[String]); 2] = [
            ("operator-token-file", &tokens.operator),
            ("agent-token-file", &tokens.agent),
        ];
        for (flag, lines) in files_and_scopes {
            let is_agent = flag == "agent-token-file";
            let bare = if is_agent {
                Holder::Agent(None)
            } else {
                Holder::Operator(OperatorRole::Admin)
            };
            let scope = |qualifier: &str| -> Result<Holder, String> {
                if is_agent {
                    if qualifier == "*" {
                        return Ok(Holder::Agent(None));
                    }
                    // Never echo the field: on a line with its fields swapped it is the token.
                    RegionId::parse(qualifier)
                        .map(|region| Holder::Agent(Some(region)))
                        .map_err(|_| {
                            "the first field is not a region id (or *); expected `<region> <token>`"
                                .to_owned()
                        })
                } else {
                    OperatorRole::parse(qualifier).map(Holder::Operator).ok_or_else(|| {
                        "the first field is not one of admin, author, viewer; expected `<role> <token>`"
                            .to_owned()
                    })
                }
            };
            let mut found = 0;
            for (number, line) in lines.iter().enumerate() {
                let parsed = parse_line(line, scope, &bare)
                    .map_err(|e| format!("--{flag}: line {}: {e}", number + 1))?;
                let Some((digest, holder)) = parsed else {
                    continue;
                };
                if holder == Holder::Agent(None) {
                    unscoped_agent_tokens += 1;
                }
                let credential = Credential {
                    id: digest.file_id(),
                    holder,
                };
                if files.insert(digest, credential).is_some() {
                    return Err(format!(
                        "--{flag}: line {}: the same token appears twice",
                        number + 1
                    ));
                }
                found += 1;
            }
            if found == 0 {
                return Err(format!("--{flag}: no token in the file"));
            }
        }
        Ok(Self {
            files,
            stored: ArcSwap::default(),
            unscoped_agent_tokens,
        })
    }

    /// The credential `token` stands for, if any.
    pub fn authenticate(&self, token: &str) -> Option<Credential> {
        if check_token_shape(token).is_err() {
            return None;
        }
        let digest = TokenDigest::of(token);
        if let Some(credential) = self.files.get(&digest) {
            return Some(credential.clone());
        }
        self.stored.load().get(&digest).cloned()
    }

    /// File tokens (ids and holders), for listings.
    pub fn file_credentials(&self) -> Vec<Credential> {
        let mut credentials: Vec<Credential> = self.files.values().cloned().collect();
        credentials.sort_by(|a, b| a.id.cmp(&b.id));
        credentials
    }

    /// Replaces the stored tokens with `records`.
    pub fn replace_stored(&self, records: &[StoredToken]) {
        let map = records
            .iter()
            .filter_map(|record| {
                let digest = TokenDigest::parse(&record.digest)?;
                Some((digest, record.credential()?))
            })
            .collect();
        self.stored.store(Arc::new(map));
    }
}

/// A minted token as the store keeps it: never the token, only its digest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct StoredToken {
    /// `tok-<hex>`.
    pub id: String,
    /// `viewer`, `author`, `admin` or `agent`.
    pub role: String,
    /// The region an agent token is scoped to.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub region: Option<RegionId>,
    /// A name for humans.
    pub name: String,
    /// `sha256:<hex>` of the token.
    pub digest: String,
    /// When it was minted, epoch ms.
    pub created_at_ms: u64,
    /// Who minted it (`<kind>:<id>`).
    pub created_by: String,
}

impl StoredToken {
    /// The credential it grants; `None` for a record this version cannot read.
    pub fn credential(&self) -> Option<Credential> {
        let holder = match (self.role.as_str(), &self.region) {
            ("agent", Some(region)) => Holder::Agent(Some(region.clone())),
            (role, None) => Holder::Operator(OperatorRole::parse(role)?),
            _ => return None,
        };
        Some(Credential {
            id: self.id.clone(),
            holder,
        })
    }
}

/// Errors of the token store.
#[derive(Debug, thiserror::Error)]
pub enum TokenStoreError {
    /// The store failed.
    #[error("store: {0}")]
    Store(#[from] KvError),
    /// A stored record is not JSON this version reads.
    #[error("stored token {key} is corrupt: {message}")]
    Corrupt {
        /// Its key.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// [`MAX_STORED_TOKENS`] reached.
    #[error("the store already holds {MAX_STORED_TOKENS} tokens; revoke some first")]
    Full,
}

/// Reads every stored token. A record this version cannot read is skipped, logged and counted
/// (`allot_token_records_unreadable`): one bad record must not stop every other token's refresh.
pub async fn list_stored_tokens(kv: &dyn Kv) -> Result<Vec<StoredToken>, TokenStoreError> {
    let mut unreadable = 0u64;
    let records = kv
        .get_prefix(TOKEN_PREFIX, MAX_STORED_TOKENS + 1)
        .await?
        .into_iter()
        .filter_map(|(key, versioned)| {
            serde_json::from_slice(&versioned.value)
                .map_err(|error| {
                    unreadable += 1;
                    tracing::warn!(%key, %error, "stored token record unreadable; skipped");
                })
                .ok()
        })
        .collect();
    metrics::gauge!(crate::metrics::TOKEN_RECORDS_UNREADABLE).set(unreadable as f64);
    Ok(records)
}

/// A freshly minted token: the record stored, and the token itself (shown once, never stored).
#[derive(Debug)]
pub struct MintedToken {
    /// What the store keeps.
    pub record: StoredToken,
    /// The bearer token.
    pub token: String,
}

/// Mints a token for `holder` and stores its digest.
pub async fn mint_token(
    kv: &dyn Kv,
    holder: &Holder,
    name: &str,
    created_by: &str,
    now_ms: u64,
) -> Result<MintedToken, TokenStoreError> {
    if list_stored_tokens(kv).await?.len() >= MAX_STORED_TOKENS {
        return Err(TokenStoreError::Full);
    }
    let token = format!(
        "{MINTED_TOKEN_PREFIX}{}",
        hex::encode(rand::random::<[u8; 32]>())
    );
    let id = TokenId::mint().to_string();
    let (role, region) = match holder {
        Holder::Operator(role) => (role.as_str().to_owned(), None),
        Holder::Agent(region) => ("agent".to_owned(), region.clone()),
    };
    let record = StoredToken {
        id: id.clone(),
        role,
        region,
        name: name.to_owned(),
        digest: TokenDigest::of(&token).to_string(),
        created_at_ms: now_ms,
        created_by: created_by.to_owned(),
    };
    let key = format!("{TOKEN_PREFIX}{id}");
    let value = serde_json::to_vec(&record).map_err(|e| TokenStoreError::Corrupt {
        key: key.clone(),
        message: e.to_string(),
    })?;
    kv.txn(
        vec![Compare::ModRevision {
            key: key.clone(),
            revision: 0,
        }],
        vec![Op::Put {
            key,
            value,
            lease: None,
        }],
    )
    .await?;
    Ok(MintedToken { record, token })
}

/// Deletes a stored token. Returns the record, or `None` when there is no such token.
pub async fn revoke_token(
    kv: &dyn Kv,
    id: &TokenId,
) -> Result<Option<StoredToken>, TokenStoreError> {
    let key = format!("{TOKEN_PREFIX}{id}");
    let Some(versioned) = kv.get(&key).await? else {
        return Ok(None);
    };
    // Deleted whether or not it reads: an unreadable record must stay removable.
    let record: Option<StoredToken> = serde_json::from_slice(&versioned.value).ok();
    kv.txn(vec![], vec![Op::Delete { key }]).await?;
    Ok(Some(record.unwrap_or_else(|| StoredToken {
        id: id.to_string(),
        role: "unreadable".to_owned(),
        region: None,
        name: String::new(),
        digest: String::new(),
        created_at_ms: 0,
        created_by: String::new(),
    })))
}

/// Re-reads the stored tokens into `book` now.
pub async fn refresh(kv: &dyn Kv, book: &TokenBook) -> Result<(), TokenStoreError> {
    let records = list_stored_tokens(kv).await?;
    book.replace_stored(&records);
    Ok(())
}

/// Keeps `book` in step with the store until `shutdown` resolves. A failed read keeps the last
/// known tokens (an unreachable store must not lock agents out).
pub async fn keep_fresh(kv: Arc<dyn Kv>, book: Arc<TokenBook>, shutdown: impl Future<Output = ()>) {
    tokio::pin!(shutdown);
    let mut tick = tokio::time::interval(TOKEN_REFRESH_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = &mut shutdown => return,
            _ = tick.tick() => {
                if let Err(error) = refresh(&*kv, &book).await {
                    tracing::warn!(%error, "stored tokens not refreshed; keeping the last known");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn book(operator: &[&str], agent: &[&str]) -> Result<TokenBook, String> {
        TokenBook::from_files(&Tokens {
            operator: operator.iter().map(|s| (*s).to_owned()).collect(),
            agent: agent.iter().map(|s| (*s).to_owned()).collect(),
        })
    }

    #[test]
    fn file_lines_give_roles_and_regions() {
        let digest = TokenDigest::of("viewer-token-000000001");
        let viewer_line = format!("viewer {digest}");
        let book = book(
            &[
                "# operators",
                "admin-token-0000000001",
                "author author-token-00000001",
                &viewer_line,
            ],
            &["eu agent-eu-token-00000001", "agent-any-token-000000001"],
        )
        .expect("valid files");
        let holder = |token: &str| book.authenticate(token).map(|c| c.holder);
        assert_eq!(
            holder("admin-token-0000000001"),
            Some(Holder::Operator(OperatorRole::Admin))
        );
        assert_eq!(
            holder("author-token-00000001"),
            Some(Holder::Operator(OperatorRole::Author))
        );
        assert_eq!(
            holder("viewer-token-000000001"),
            Some(Holder::Operator(OperatorRole::Viewer))
        );
        let eu = RegionId::parse("eu").expect("region");
        let us = RegionId::parse("us").expect("region");
        let agent = book.authenticate("agent-eu-token-00000001").expect("agent");
        assert!(agent.may_act_for(&eu) && !agent.may_act_for(&us));
        let any = book
            .authenticate("agent-any-token-000000001")
            .expect("agent");
        assert!(any.may_act_for(&eu) && any.may_act_for(&us));
        assert_eq!(book.unscoped_agent_tokens, 1);
        assert_eq!(book.authenticate("unknown-token-00000000"), None);
        assert_eq!(book.authenticate("short"), None);
        assert!(agent.actor().starts_with("agent:file-"));
    }

    #[test]
    fn bad_lines_are_named() {
        let cases: [(&[&str], &[&str], &str); 6] = [
            (
                &["root admin-token-0000000001"],
                &["agent-token-000000001"],
                "line 1: the first field is not one of admin",
            ),
            (
                &["short"],
                &["agent-token-000000001"],
                "line 1: shorter than 16",
            ),
            (
                &["# nothing"],
                &["agent-token-000000001"],
                "operator-token-file: no token",
            ),
            (
                &["admin-token-0000000001"],
                &["EU agent-token-000000001"],
                "agent-token-file: line 1: the first field is not a region",
            ),
            (
                &["admin-token-0000000001"],
                &["eu sha256:abc"],
                "64 hex digits",
            ),
            (
                &["admin-token-0000000001", "viewer admin-token-0000000001"],
                &["agent-token-000000001"],
                "line 2: the same token appears twice",
            ),
        ];
        for (operator, agent, expected) in cases {
            let error = book(operator, agent).expect_err("must be refused");
            assert!(error.contains(expected), "{error:?} lacks {expected:?}");
        }
    }

    #[test]
    fn stored_records_grant_what_they_name() {
        let book = book(&["admin-token-0000000001"], &["agent-token-000000001"]).expect("book");
        let record = |role: &str, region: Option<&str>, token: &str| StoredToken {
            id: format!("tok-{role}"),
            role: role.to_owned(),
            region: region.map(|r| RegionId::parse(r).expect("region")),
            name: String::new(),
            digest: TokenDigest::of(token).to_string(),
            created_at_ms: 0,
            created_by: "admin:file-00000000".to_owned(),
        };
        book.replace_stored(&[
            record("author", None, "minted-author-0000001"),
            record("agent", Some("us"), "minted-agent-00000001"),
            // Unreadable combinations grant nothing.
            record("agent", None, "minted-unscoped-000001"),
            record("root", None, "minted-root-000000001"),
        ]);
        assert_eq!(
            book.authenticate("minted-author-0000001").map(|c| c.holder),
            Some(Holder::Operator(OperatorRole::Author))
        );
        assert_eq!(
            book.authenticate("minted-agent-00000001").map(|c| c.holder),
            Some(Holder::Agent(Some(RegionId::parse("us").expect("region"))))
        );
        assert_eq!(book.authenticate("minted-unscoped-000001"), None);
        assert_eq!(book.authenticate("minted-root-000000001"), None);
        book.replace_stored(&[]);
        assert_eq!(book.authenticate("minted-author-0000001"), None);
    }
}

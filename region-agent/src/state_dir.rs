//! The agent's state directory (`--state-dir`): what a restarted agent needs to keep its region up
//! while the allocator is unreachable, and to lose no accounting when it was killed.
//!
//! | file | what | written |
//! | --- | --- | --- |
//! | `bundle.state` | the last bundle the allocator gave (verified by its own checksum on load) | when one is installed |
//! | `journal.state` | per pool: its last terms (`G`, window, chunk, TTL, fallback), the leases held or owed a final report with what they spent, each window's fallback admits and durable claims; when the bundle was last confirmed | every journal interval when something changed, and before fallback beyond a claim is admitted |
//!
//! Every file is one header line (`{"format":"allot-agent-state","version":1,"kind":..,"region":..,
//! "sha256":..}`) and the content (JSON), whose SHA-256 the header states. Writes are atomic: a
//! temporary file in the directory, written, synced, renamed over the old one, then the directory
//! synced; a crash leaves the old file or the new one, never half of one. A file that is missing
//! starts nothing; one that is corrupt, of another format or version, another kind, or another
//! region's, is ignored with one log line and `allot_agent_state_files_ignored_total{file,reason}`,
//! never a crash. Each file is at most [`MAX_STATE_FILE_BYTES`]; the directory holds these two and,
//! for a moment during a write, one temporary file each.

use std::io::Write;
use std::path::{Path, PathBuf};

use allot_shared::ids::{PoolId, RegionId, TenantId};
use allot_shared::wire::PoolTerms;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::global::HolderSnapshot;
pub use crate::global::tallies::TallyWindow;

/// The format name in every header.
pub const STATE_FORMAT: &str = "allot-agent-state";
/// The format version this agent writes and reads.
pub const STATE_FORMAT_VERSION: u32 = 1;
/// Largest state file written or read (I10): a bundle is at most 4 MiB; pool terms and the
/// journal are bounded by the pools held and the holders' own bounds.
pub const MAX_STATE_FILE_BYTES: usize = 64 << 20;

/// The files of a state directory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StateFile {
    /// The last verified bundle.
    Bundle,
    /// Pool terms, pending accounting and fallback claims.
    Journal,
    /// The last verified set of operators' rule overrides.
    Overrides,
}

impl StateFile {
    /// The file's name in the directory.
    pub fn name(self) -> &'static str {
        match self {
            StateFile::Bundle => "bundle.state",
            StateFile::Journal => "journal.state",
            StateFile::Overrides => "overrides.state",
        }
    }

    /// The `kind` its header states.
    fn kind(self) -> &'static str {
        match self {
            StateFile::Bundle => "bundle",
            StateFile::Journal => "journal",
            StateFile::Overrides => "overrides",
        }
    }
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
struct Header {
    format: String,
    version: u32,
    kind: String,
    region: RegionId,
    sha256: String,
}

/// The last bundle the allocator gave, in its wire form (version and checksum included).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct SavedBundle {
    /// `PolicyBundle::to_json`.
    pub bundle: serde_json::Value,
}

/// One pool's terms, pending accounting and claims.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JournaledPool {
    /// The tenant.
    pub tenant: TenantId,
    /// The pool.
    pub pool: PoolId,
    /// The terms in force.
    pub terms: PoolTerms,
    /// When they were fetched, epoch ms.
    pub terms_fetched_at_ms: u64,
    /// Its holder's snapshot.
    pub holder: HolderSnapshot,
    /// What a shadow global rule of the pool counted per window.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shadow: Vec<TallyWindow>,
    /// The most settle debt the holder carried per window.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub settle_debt: Vec<TallyWindow>,
    /// Extra cost of settled metered requests written off per window.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub written_off: Vec<TallyWindow>,
}

/// The journal.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct Journal {
    /// When it was written (the agent's clock), epoch ms.
    pub written_at_ms: u64,
    /// When the allocator last confirmed the bundle in force, epoch ms (0: never): a restarted
    /// agent ages its bundle from here, so `strict` rules keep their maximum age.
    pub bundle_confirmed_at_ms: u64,
    /// Every pool held.
    pub pools: Vec<JournaledPool>,
}

/// Why a state file was not used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Unusable {
    /// It could not be read (other than missing).
    #[error("unreadable: {0}")]
    Unreadable(String),
    /// Larger than [`MAX_STATE_FILE_BYTES`].
    #[error("larger than {MAX_STATE_FILE_BYTES} bytes")]
    TooLarge,
    /// Not this format, version or kind.
    #[error("foreign: {0}")]
    Foreign(String),
    /// Another region's.
    #[error("written by an agent of region {0}")]
    OtherRegion(String),
    /// The content does not match its checksum, or does not parse.
    #[error("corrupt: {0}")]
    Corrupt(String),
}

impl Unusable {
    /// The metric label.
    pub fn reason(&self) -> &'static str {
        match self {
            Unusable::Unreadable(_) => "unreadable",
            Unusable::TooLarge => "too_large",
            Unusable::Foreign(_) => "foreign",
            Unusable::OtherRegion(_) => "other_region",
            Unusable::Corrupt(_) => "corrupt",
        }
    }
}

/// A state directory of one agent's region.
#[derive(Debug, Clone)]
pub struct StateDir {
    path: PathBuf,
    region: RegionId,
    /// One write at a time, whoever asks (a caller that stops waiting does not stop its write).
    writing: std::sync::Arc<std::sync::Mutex<()>>,
}

impl StateDir {
    /// The directory at `path` (created, owner-only, when missing) for an agent of `region`.
    pub fn open(path: &Path, region: RegionId) -> std::io::Result<Self> {
        std::fs::create_dir_all(path)?;
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))?;
        }
        Ok(Self {
            path: path.to_path_buf(),
            region,
            writing: std::sync::Arc::default(),
        })
    }

    /// The directory.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads `file`: `None` when it does not exist or cannot be used (logged once per call and
    /// counted, never fatal).
    pub fn load<T: DeserializeOwned>(&self, file: StateFile) -> Option<T> {
        match self.read(file) {
            Ok(content) => content,
            Err(unusable) => {
                self.ignored(file, unusable.reason(), &unusable);
                None
            }
        }
    }

    /// Logs and counts `file` as ignored for `reason` (`detail` says more): one read of it, or
    /// content that read well and then did not verify.
    pub fn ignored(&self, file: StateFile, reason: &'static str, detail: &dyn std::fmt::Display) {
        tracing::warn!(file = file.name(), dir = %self.path.display(), reason, %detail,
            "state file ignored");
        metrics::counter!(crate::metrics::STATE_FILES_IGNORED,
            "file" => file.name(), "reason" => reason)
        .increment(1);
    }

    /// Reads `file`: `Ok(None)` when it does not exist.
    pub fn read<T: DeserializeOwned>(&self, file: StateFile) -> Result<Option<T>, Unusable> {
        let path = self.path.join(file.name());
        let bytes = match read_capped(&path) {
            Ok(bytes) => bytes,
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(error) if error.kind() == std::io::ErrorKind::FileTooLarge => {
                return Err(Unusable::TooLarge);
            }
            Err(error) => return Err(Unusable::Unreadable(error.to_string())),
        };
        let (header, content) = match bytes.iter().position(|&b| b == b'\n') {
            Some(end) => (&bytes[..end], &bytes[end + 1..]),
            None => return Err(Unusable::Foreign("no header line".to_owned())),
        };
        let header: Header = serde_json::from_slice(header)
            .map_err(|e| Unusable::Foreign(format!("header: {e}")))?;
        if header.format != STATE_FORMAT || header.version != STATE_FORMAT_VERSION {
            return Err(Unusable::Foreign(format!(
                "format {} version {}",
                header.format, header.version
            )));
        }
        if header.kind != file.kind() {
            return Err(Unusable::Foreign(format!("a {} file", header.kind)));
        }
        if header.region != self.region {
            return Err(Unusable::OtherRegion(header.region.to_string()));
        }
        if header.sha256 != hex::encode(Sha256::digest(content)) {
            return Err(Unusable::Corrupt("checksum mismatch".to_owned()));
        }
        serde_json::from_slice(content)
            .map(Some)
            .map_err(|e| Unusable::Corrupt(e.to_string()))
    }

    /// Writes `file` atomically and durably (see the module docs). Refuses content larger than
    /// [`MAX_STATE_FILE_BYTES`].
    pub fn write<T: Serialize>(&self, file: StateFile, content: &T) -> std::io::Result<()> {
        let content = serde_json::to_vec(content).map_err(std::io::Error::other)?;
        let header = serde_json::to_vec(&Header {
            format: STATE_FORMAT.to_owned(),
            version: STATE_FORMAT_VERSION,
            kind: file.kind().to_owned(),
            region: self.region.clone(),
            sha256: hex::encode(Sha256::digest(&content)),
        })
        .map_err(std::io::Error::other)?;
        if header.len() + 1 + content.len() > MAX_STATE_FILE_BYTES {
            return Err(std::io::Error::new(
                std::io::ErrorKind::FileTooLarge,
                format!("{} would exceed {MAX_STATE_FILE_BYTES} bytes", file.name()),
            ));
        }
        let _one_writer = self
            .writing
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        let target = self.path.join(file.name());
        // Named for this process too: two processes on one directory (a misconfiguration) never
        // write into each other's temporary file.
        let temporary = self
            .path
            .join(format!(".{}.{}.tmp", file.name(), std::process::id()));
        let mut out = std::fs::File::create(&temporary)?;
        out.write_all(&header)?;
        out.write_all(b"\n")?;
        out.write_all(&content)?;
        out.sync_all()?;
        drop(out);
        std::fs::rename(&temporary, &target)?;
        // The rename itself is durable once the directory is.
        std::fs::File::open(&self.path)?.sync_all()
    }
}

fn read_capped(path: &Path) -> std::io::Result<Vec<u8>> {
    use std::io::Read;
    let file = std::fs::File::open(path)?;
    let mut bytes = Vec::new();
    file.take(MAX_STATE_FILE_BYTES as u64 + 1)
        .read_to_end(&mut bytes)?;
    if bytes.len() > MAX_STATE_FILE_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::FileTooLarge,
            "state file too large",
        ));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(name: &str) -> RegionId {
        RegionId::parse(name).expect("region")
    }

    #[test]
    fn a_written_file_reads_back_and_anything_else_is_ignored_with_its_reason() {
        let dir = tempfile::tempdir().expect("temp dir");
        let eu = StateDir::open(dir.path(), region("eu")).expect("opens");
        assert_eq!(
            eu.read::<Journal>(StateFile::Journal),
            Ok(None),
            "missing: nothing"
        );
        let journal = Journal {
            written_at_ms: 7,
            bundle_confirmed_at_ms: 5,
            pools: Vec::new(),
        };
        eu.write(StateFile::Journal, &journal).expect("writes");
        assert_eq!(eu.read(StateFile::Journal), Ok(Some(journal.clone())));
        let leftovers: Vec<_> = std::fs::read_dir(dir.path())
            .expect("list")
            .filter_map(Result::ok)
            .filter(|entry| entry.file_name().to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "renamed: {leftovers:?}");

        // Another region's agent does not use it.
        let us = StateDir::open(dir.path(), region("us")).expect("opens");
        assert_eq!(
            us.read::<Journal>(StateFile::Journal)
                .map_err(|e| e.reason()),
            Err("other_region")
        );
        // Nor is it a bundle file.
        assert_eq!(
            eu.read::<SavedBundle>(StateFile::Bundle).map(|_| ()),
            Ok(()),
            "no bundle file yet"
        );
        std::fs::copy(
            dir.path().join("journal.state"),
            dir.path().join("bundle.state"),
        )
        .expect("copy");
        assert_eq!(
            eu.read::<SavedBundle>(StateFile::Bundle)
                .map_err(|e| e.reason()),
            Err("foreign")
        );
        // A flipped byte in the content fails its checksum.
        let path = dir.path().join("journal.state");
        let mut bytes = std::fs::read(&path).expect("read");
        let last = bytes.len() - 2;
        bytes[last] ^= 1;
        std::fs::write(&path, &bytes).expect("write");
        assert_eq!(
            eu.read::<Journal>(StateFile::Journal)
                .map_err(|e| e.reason()),
            Err("corrupt")
        );
        // Garbage, an empty file, a truncated one: foreign or corrupt, never a panic.
        for garbage in [
            &b""[..],
            b"\xff\xfe",
            b"{\"format\":\"x\"}\n{}",
            &bytes[..bytes.len() / 2],
        ] {
            std::fs::write(&path, garbage).expect("write");
            let reason = eu
                .read::<Journal>(StateFile::Journal)
                .map_err(|e| e.reason());
            assert!(
                matches!(reason, Err("foreign" | "corrupt")),
                "{garbage:?}: {reason:?}"
            );
            assert_eq!(eu.load::<Journal>(StateFile::Journal), None);
        }
    }
}

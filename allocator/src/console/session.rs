//! Console sessions: a signed-in operator's token kept on the server, behind a random cookie.
//!
//! The browser holds only a random session id (HttpOnly, SameSite=Strict); the operator token it
//! stands for never leaves the server again. The store keys sessions by the id's SHA-256, so a
//! memory dump shows no usable cookie. Every session carries its own CSRF token, compared in
//! constant time. Sessions end on sign-out, after [`IDLE_TIMEOUT_MS`] without a request, after
//! [`ABSOLUTE_TIMEOUT_MS`] in any case, and when the API stops accepting their token (revoked).
//! At most [`MAX_SESSIONS`] live at once: a new sign-in past that evicts the least recently used
//! (I10). Sessions live in this allocator's memory: after a failover the operator signs in again.

use std::collections::HashMap;
use std::sync::Mutex;

use rand::RngCore;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::auth::OperatorRole;

/// The session cookie's name.
pub const COOKIE_NAME: &str = "allot_console";
/// A session unused this long ends.
pub const IDLE_TIMEOUT_MS: u64 = 30 * 60 * 1_000;
/// A session ends this long after sign-in, used or not.
pub const ABSOLUTE_TIMEOUT_MS: u64 = 12 * 60 * 60 * 1_000;
/// Most sessions held at once.
pub const MAX_SESSIONS: usize = 10_000;
/// Random bytes in a session id and in a CSRF token.
const SECRET_BYTES: usize = 32;

/// A signed-in operator.
#[derive(Debug, Clone)]
pub struct Session {
    /// The operator token the console acts with.
    pub token: String,
    /// Its role, as the token book said at sign-in (the API checks again on every call).
    pub role: OperatorRole,
    /// The token's id, shown in the header (never the token).
    pub token_id: String,
    /// The form token every change must carry.
    pub csrf: String,
    signed_in_at_ms: u64,
    last_seen_at_ms: u64,
}

impl Session {
    /// Whether `presented` is this session's CSRF token (constant time).
    pub fn csrf_matches(&self, presented: &str) -> bool {
        !presented.is_empty() && bool::from(self.csrf.as_bytes().ct_eq(presented.as_bytes()))
    }

    fn expired(&self, now_ms: u64) -> bool {
        now_ms >= self.signed_in_at_ms.saturating_add(ABSOLUTE_TIMEOUT_MS)
            || now_ms >= self.last_seen_at_ms.saturating_add(IDLE_TIMEOUT_MS)
    }
}

/// The live sessions of this allocator.
#[derive(Debug, Default)]
pub struct Sessions {
    by_id_digest: Mutex<HashMap<[u8; 32], Session>>,
}

fn digest(session_id: &str) -> [u8; 32] {
    Sha256::digest(session_id.as_bytes()).into()
}

fn random_secret() -> String {
    let mut bytes = [0u8; SECRET_BYTES];
    rand::rng().fill_bytes(&mut bytes);
    hex::encode(bytes)
}

impl Sessions {
    /// Starts a session for `token` and answers its id (for the cookie).
    pub fn sign_in(
        &self,
        token: String,
        role: OperatorRole,
        token_id: String,
        now_ms: u64,
    ) -> String {
        let session_id = random_secret();
        let session = Session {
            token,
            role,
            token_id,
            csrf: random_secret(),
            signed_in_at_ms: now_ms,
            last_seen_at_ms: now_ms,
        };
        let mut sessions = self.lock();
        sessions.retain(|_, s| !s.expired(now_ms));
        if sessions.len() >= MAX_SESSIONS {
            let least_recent = sessions
                .iter()
                .min_by_key(|(_, s)| s.last_seen_at_ms)
                .map(|(key, _)| *key);
            if let Some(key) = least_recent {
                sessions.remove(&key);
            }
        }
        sessions.insert(digest(&session_id), session);
        debug_assert!(sessions.len() <= MAX_SESSIONS);
        session_id
    }

    /// The live session behind `session_id`, marked as used now; an expired one ends here.
    pub fn touch(&self, session_id: &str, now_ms: u64) -> Option<Session> {
        let key = digest(session_id);
        let mut sessions = self.lock();
        let session = sessions.get_mut(&key)?;
        if session.expired(now_ms) {
            sessions.remove(&key);
            return None;
        }
        session.last_seen_at_ms = session.last_seen_at_ms.max(now_ms);
        Some(session.clone())
    }

    /// Ends the session behind `session_id`, if any.
    pub fn sign_out(&self, session_id: &str) {
        self.lock().remove(&digest(session_id));
    }

    /// How many sessions are held (expired ones included until they are next seen).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether none is held.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<[u8; 32], Session>> {
        // A panic while holding this lock cannot leave a session half-written: every change is a
        // single insert or remove.
        self.by_id_digest
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signed_in(sessions: &Sessions, now_ms: u64) -> String {
        sessions.sign_in(
            "operator-token-0123456789".to_owned(),
            OperatorRole::Author,
            "tok".to_owned(),
            now_ms,
        )
    }

    #[test]
    fn a_session_is_found_by_its_id_only() {
        let sessions = Sessions::default();
        let id = signed_in(&sessions, 0);
        assert!(sessions.touch(&id, 1).is_some());
        assert!(sessions.touch("not-a-session", 1).is_none());
        assert_eq!(id.len(), 2 * SECRET_BYTES);
    }

    #[test]
    fn sessions_end_when_idle_and_after_the_absolute_timeout() {
        let sessions = Sessions::default();
        let id = signed_in(&sessions, 0);
        assert!(sessions.touch(&id, IDLE_TIMEOUT_MS - 1).is_some());
        assert!(sessions.touch(&id, 2 * IDLE_TIMEOUT_MS - 2).is_some());
        assert!(sessions.touch(&id, 3 * IDLE_TIMEOUT_MS).is_none(), "idle");

        let id = signed_in(&sessions, 0);
        let mut now_ms = 0;
        while now_ms + IDLE_TIMEOUT_MS / 2 < ABSOLUTE_TIMEOUT_MS {
            now_ms += IDLE_TIMEOUT_MS / 2;
            assert!(sessions.touch(&id, now_ms).is_some());
        }
        assert!(
            sessions.touch(&id, ABSOLUTE_TIMEOUT_MS).is_none(),
            "absolute"
        );
    }

    #[test]
    fn sign_out_ends_the_session() {
        let sessions = Sessions::default();
        let id = signed_in(&sessions, 0);
        sessions.sign_out(&id);
        assert!(sessions.touch(&id, 1).is_none());
        assert!(sessions.is_empty());
    }

    #[test]
    fn csrf_tokens_differ_per_session_and_must_match_exactly() {
        let sessions = Sessions::default();
        let a = sessions.touch(&signed_in(&sessions, 0), 0).expect("a");
        let b = sessions.touch(&signed_in(&sessions, 0), 0).expect("b");
        assert_ne!(a.csrf, b.csrf);
        assert!(a.csrf_matches(&a.csrf));
        assert!(!a.csrf_matches(&b.csrf));
        assert!(!a.csrf_matches(""));
        assert!(!a.csrf_matches(&a.csrf[1..]));
    }

    #[test]
    fn the_store_is_bounded_and_evicts_the_least_recently_used() {
        let sessions = Sessions::default();
        let first = signed_in(&sessions, 0);
        for now_ms in 1..MAX_SESSIONS as u64 {
            signed_in(&sessions, now_ms);
        }
        assert_eq!(sessions.len(), MAX_SESSIONS);
        assert!(sessions.touch(&first, MAX_SESSIONS as u64).is_some());
        let newest = signed_in(&sessions, MAX_SESSIONS as u64 + 1);
        assert_eq!(sessions.len(), MAX_SESSIONS);
        assert!(sessions.touch(&newest, MAX_SESSIONS as u64 + 1).is_some());
        assert!(
            sessions.touch(&first, MAX_SESSIONS as u64 + 1).is_some(),
            "the recently used session stays"
        );
    }
}

//! Threshold webhooks: an operator registers an HTTPS endpoint for a tenant (every pool of it) or
//! one pool, and the percentages of a window's quota to hear about (80 and 100 unless told). The
//! leader's webhook job ([`keep_webhooks`]) finds each crossing from the pools' window states
//! (tokens granted against the limit: what regions took, the most they can admit outside
//! fallback), records it once in the ledger under an id made from what it is about, and delivers
//! it signed, retrying with backoff until the endpoint answers 2xx or the attempts run out.
//!
//! Bounds (I10): at most [`MAX_WEBHOOKS`] registrations, [`MAX_PENDING_EVENTS`] undelivered events
//! (a crossing past that is counted and dropped), [`POOLS_PER_SWEEP`] pools looked at per sweep (in
//! rotation), [`DELIVERIES_PER_ROUND`] deliveries in memory at once, [`DELIVERY_TIMEOUT`] per
//! attempt, [`MAX_ATTEMPTS`] attempts per event, done events kept [`EVENT_RETENTION_MS`].

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use allot_shared::ids::{PoolId, TenantId};
use hmac::{Hmac, KeyInit, Mac};
use serde::{Deserialize, Serialize};
use sha2::Sha256;
use tokio::sync::watch;

use crate::clock::Clock;
use crate::kv::Kv;
use crate::leader::Roles;
use crate::ledger::{Ledger, PendingEvent};

pub mod addresses;

/// Most webhooks registered at once.
pub const MAX_WEBHOOKS: u64 = 1_000;
/// Most events awaiting delivery; a crossing found past this is dropped and counted.
pub const MAX_PENDING_EVENTS: u64 = 10_000;
/// Most (webhook, pool) pairs one sweep looks at; more are taken in rotation, sweep by sweep.
pub const POOLS_PER_SWEEP: usize = 1_000;
/// Most deliveries attempted (and held in memory) per round.
pub const DELIVERIES_PER_ROUND: u32 = 32;
/// Longest one delivery attempt may take.
pub const DELIVERY_TIMEOUT: Duration = Duration::from_secs(5);
/// Attempts per event before it is marked failed (spanning about 34 minutes).
pub const MAX_ATTEMPTS: u32 = 15;
/// The pause after the first failed attempt; doubled per attempt up to [`MAX_BACKOFF_MS`].
pub const FIRST_BACKOFF_MS: u64 = 1_000;
/// The longest pause between attempts.
pub const MAX_BACKOFF_MS: u64 = 300_000;
/// How long a rotated-out secret still signs, beside the new one.
pub const SECRET_OVERLAP_MS: u64 = 24 * 60 * 60 * 1_000;
/// How often the job delivers; it sweeps every [`SWEEP_EVERY`] rounds.
pub const ROUND_INTERVAL: Duration = Duration::from_secs(1);
/// Rounds between sweeps for crossings.
pub const SWEEP_EVERY: u32 = 5;
/// How long delivered and failed events are kept.
pub const EVENT_RETENTION_MS: u64 = 7 * 24 * 60 * 60 * 1_000;
/// Most done events removed per sweep.
pub const PRUNED_PER_SWEEP: u32 = 1_000;
/// The thresholds of a webhook that names none, percent.
pub const DEFAULT_THRESHOLDS_PCT: [u8; 2] = [80, 100];

/// The header carrying the signatures: `t=<ms>,v1=<hex>[,v1=<hex>]`.
pub const SIGNATURE_HEADER: &str = "allot-signature";
/// The header carrying the event id (also in the body).
pub const EVENT_ID_HEADER: &str = "allot-event-id";

/// What a delivery says.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct ThresholdEvent {
    /// Unique per webhook, pool, window and threshold: a receiver that saw it may drop a repeat.
    pub event_id: String,
    /// Always `quota.threshold`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The webhook it was registered for.
    pub webhook_id: String,
    /// The tenant.
    pub tenant: TenantId,
    /// The pool.
    pub pool: PoolId,
    /// The threshold reached, percent of the window's limit.
    pub threshold_pct: u8,
    /// The window's start, epoch ms.
    pub window_start_ms: u64,
    /// The window's end, epoch ms.
    pub window_end_ms: u64,
    /// `G`, the window's limit, tokens.
    pub limit: u64,
    /// Tokens granted in the window when the crossing was found.
    pub granted: u64,
    /// Tokens admitted in fallback in the window by then, as the ledger holds them (every agent of
    /// every region): admitted beyond any grant while a region was cut off. A threshold is reached
    /// by `granted + fallbackAdmitted`.
    #[serde(default)]
    pub fallback_admitted: u64,
    /// When it was found, epoch ms.
    pub detected_at_ms: u64,
}

/// The thresholds in `thresholds_pct` that `consumed` of `limit` has reached.
pub fn reached(consumed: u64, limit: u64, thresholds_pct: &[u8]) -> impl Iterator<Item = u8> + '_ {
    thresholds_pct.iter().copied().filter(move |&pct| {
        limit > 0 && u128::from(consumed) * 100 >= u128::from(pct) * u128::from(limit)
    })
}

/// The id of the event for `webhook` reaching `threshold_pct` of `tenant`/`pool` in the window
/// starting at `window_start_ms`: the first 128 bits of a SHA-256 of them, in hex.
pub fn event_id(
    webhook: &str,
    tenant: &TenantId,
    pool: &PoolId,
    window_start_ms: u64,
    threshold_pct: u8,
) -> String {
    let id =
        allot_shared::ids::content_id(&[&webhook, tenant, pool, &window_start_ms, &threshold_pct]);
    format!("evt-{id}")
}

/// The `Allot-Signature` value for `body` sent at `timestamp_ms`: one `v1` per secret, each the
/// hex HMAC-SHA256 of `<timestamp_ms>.<body>`.
pub fn signature_header(secrets: &[&str], timestamp_ms: u64, body: &[u8]) -> String {
    let mut header = format!("t={timestamp_ms}");
    for secret in secrets {
        let Ok(mut mac) = <Hmac<Sha256> as KeyInit>::new_from_slice(secret.as_bytes()) else {
            continue;
        };
        mac.update(timestamp_ms.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        header.push_str(",v1=");
        header.push_str(&hex::encode(mac.finalize().into_bytes()));
    }
    header
}

/// The pause before the attempt after `attempts` failed ones.
pub fn backoff_ms(attempts: u32) -> u64 {
    FIRST_BACKOFF_MS
        .saturating_mul(1 << attempts.saturating_sub(1).min(20))
        .min(MAX_BACKOFF_MS)
}

/// A fresh signing secret: `whsec_` and 32 random bytes in hex.
pub fn new_secret() -> String {
    format!("whsec_{}", hex::encode(rand::random::<[u8; 32]>()))
}

/// A fresh webhook id: `wh-` and 8 random bytes in hex.
pub fn new_webhook_id() -> String {
    format!("wh-{}", hex::encode(rand::random::<[u8; 8]>()))
}

/// How deliveries are sent: the client, and whether private addresses may be reached
/// ([`addresses`]).
#[derive(Debug, Clone)]
pub struct Delivery {
    http: reqwest::Client,
    allow_private: bool,
}

impl Delivery {
    /// The delivery client: TLS trusting `ca` (the system's CAs without one), [`DELIVERY_TIMEOUT`]
    /// per attempt, no redirects followed, and unless `allow_private`, names resolved to their
    /// public addresses only.
    pub fn new(ca: Option<PathBuf>, allow_private: bool) -> Result<Self, String> {
        let builder = reqwest::Client::builder()
            .timeout(DELIVERY_TIMEOUT)
            .redirect(reqwest::redirect::Policy::none());
        // Through a proxy from the environment, the proxy would resolve the host and the
        // resolver below would never see it: deliveries limited to public addresses go direct.
        let builder = if allow_private {
            builder
        } else {
            builder
                .no_proxy()
                .dns_resolver(Arc::new(addresses::PublicOnly))
        };
        let http = allot_net::ClientTls {
            ca,
            ..Default::default()
        }
        .configure(builder)
        .and_then(|builder| {
            builder
                .build()
                .map_err(|e| allot_net::TlsError::Config(e.to_string()))
        })
        .map_err(|e| e.to_string())?;
        Ok(Self {
            http,
            allow_private,
        })
    }
}

/// The leader's webhook job: every [`ROUND_INTERVAL`], delivers what is due; every
/// [`SWEEP_EVERY`] rounds, first looks for new crossings. Followers do nothing.
pub async fn keep_webhooks(
    ledger: Ledger,
    kv: Arc<dyn Kv>,
    clock: Arc<dyn Clock>,
    role: watch::Receiver<Roles>,
    delivery: Delivery,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let mut rounds = tokio::time::interval(ROUND_INTERVAL);
    let mut round: u32 = 0;
    let mut rotation: usize = 0;
    loop {
        tokio::select! {
            () = &mut shutdown => return,
            _ = rounds.tick() => {}
        }
        if role.borrow().coordinating().is_none() {
            continue;
        }
        if round.is_multiple_of(SWEEP_EVERY) {
            let now_ms = clock.now_ms();
            match sweep(&ledger, &*kv, now_ms, rotation).await {
                Ok(next) => rotation = next,
                Err(error) => tracing::warn!(%error, "webhook sweep failed"),
            }
            let cutoff_ms = now_ms.saturating_sub(EVENT_RETENTION_MS);
            if let Err(error) = ledger
                .prune_webhook_events(cutoff_ms, PRUNED_PER_SWEEP)
                .await
            {
                tracing::warn!(%error, "old webhook events not removed");
            }
        }
        round = round.wrapping_add(1);
        if let Err(error) = deliver_due(&ledger, &delivery, &*clock).await {
            tracing::warn!(%error, "webhook deliveries failed");
        }
    }
}

/// Looks at the next [`POOLS_PER_SWEEP`] (webhook, pool) pairs from `rotation` and records each
/// threshold reached in the pool's current window; the rotation to start from next time.
///
/// Long by design: each event records the very figures that crossed its threshold (the window's
/// grants, the fallback admitted, the limit in force), read for its pair just above it, and the
/// rotation returned indexes the list of pairs built in the same call; split, those figures would
/// be handed on to the recording and the list to the rotation.
async fn sweep(
    ledger: &Ledger,
    kv: &dyn Kv,
    now_ms: u64,
    rotation: usize,
) -> Result<usize, Box<dyn std::error::Error + Send + Sync>> {
    let webhooks = ledger.webhooks().await?;
    let mut pairs = Vec::new();
    for webhook in &webhooks {
        let prefix = match &webhook.pool {
            Some(pool) => format!("{}/{pool}", webhook.tenant),
            None => format!("{}/", webhook.tenant),
        };
        let prefix = crate::pools::PoolPrefix::parse(&prefix)?;
        for (tenant, pool, stored) in crate::pools::list_pools_matching(kv, &prefix).await? {
            if webhook.pool.as_ref().is_none_or(|wanted| *wanted == pool) {
                pairs.push((webhook, tenant, pool, stored));
            }
        }
    }
    if pairs.is_empty() {
        return Ok(0);
    }
    let start = rotation % pairs.len();
    let visited = pairs.len().min(POOLS_PER_SWEEP);
    for index in 0..visited {
        let (webhook, tenant, pool, stored) = &pairs[(start + index) % pairs.len()];
        let Ok(config) = stored.spec.validate() else {
            continue;
        };
        let window = config.window_at(now_ms);
        let granted = match crate::pools::get_window(kv, tenant, pool).await? {
            Some((state, _)) if state.window == window => state.granted_tokens(),
            _ => 0,
        };
        // What regions cut off from the allocator admitted beyond their grants counts too.
        let fallback_admitted = ledger
            .pool_fallback_admitted(tenant, pool, window.start_ms)
            .await?;
        let consumed = granted.saturating_add(fallback_admitted);
        // The limit in force now: an override's while one is.
        let limit_tokens = stored.limit_at(now_ms);
        for threshold_pct in reached(consumed, limit_tokens, &webhook.thresholds_pct) {
            let event = ThresholdEvent {
                event_id: event_id(&webhook.id, tenant, pool, window.start_ms, threshold_pct),
                kind: "quota.threshold".to_owned(),
                webhook_id: webhook.id.clone(),
                tenant: tenant.clone(),
                pool: pool.clone(),
                threshold_pct,
                window_start_ms: window.start_ms,
                window_end_ms: window.end_ms,
                limit: limit_tokens,
                granted,
                fallback_admitted,
                detected_at_ms: now_ms,
            };
            match ledger
                .record_webhook_event(&event, now_ms, MAX_PENDING_EVENTS)
                .await?
            {
                crate::ledger::EventRecorded::New => {
                    metrics::counter!(crate::metrics::WEBHOOK_EVENTS, "outcome" => "recorded")
                        .increment(1);
                }
                crate::ledger::EventRecorded::Known => {}
                crate::ledger::EventRecorded::QueueFull => {
                    metrics::counter!(crate::metrics::WEBHOOK_EVENTS, "outcome" => "dropped")
                        .increment(1);
                    tracing::warn!(webhook = %webhook.id, %tenant, %pool, threshold_pct,
                        "webhook queue full; crossing dropped");
                }
            }
        }
    }
    Ok((start + visited) % pairs.len())
}

/// Delivers up to [`DELIVERIES_PER_ROUND`] due events, each once, and records how each went.
async fn deliver_due(
    ledger: &Ledger,
    delivery: &Delivery,
    clock: &dyn Clock,
) -> Result<(), crate::ledger::LedgerError> {
    let due = ledger
        .due_webhook_events(clock.now_ms(), DELIVERIES_PER_ROUND)
        .await?;
    metrics::gauge!(crate::metrics::WEBHOOK_PENDING)
        .set(ledger.pending_webhook_events().await? as f64);
    for event in due {
        let outcome = deliver(delivery, &event, clock.now_ms()).await;
        let now_ms = clock.now_ms();
        let attempts = event.attempts + 1;
        match outcome {
            Ok(status) => {
                metrics::counter!(crate::metrics::WEBHOOK_DELIVERIES, "outcome" => "delivered")
                    .increment(1);
                ledger
                    .webhook_event_delivered(&event.event_id, attempts, status, now_ms)
                    .await?;
            }
            Err((status, error)) => {
                let failed = attempts >= MAX_ATTEMPTS;
                let outcome = if failed { "failed" } else { "retried" };
                metrics::counter!(crate::metrics::WEBHOOK_DELIVERIES, "outcome" => outcome)
                    .increment(1);
                tracing::warn!(event = %event.event_id, webhook = %event.webhook_id, attempts,
                    %error, "webhook delivery failed");
                ledger
                    .webhook_event_failed(
                        &event.event_id,
                        attempts,
                        status,
                        &error,
                        now_ms + backoff_ms(attempts),
                        failed.then_some(now_ms),
                    )
                    .await?;
            }
        }
    }
    Ok(())
}

/// One attempt: POST the payload, signed with the webhook's secrets in force. The status on 2xx,
/// or the status (if any) and what went wrong. A URL naming a non-public address is refused
/// without a connection (registered before the rule, or the rule turned on since).
async fn deliver(
    delivery: &Delivery,
    event: &PendingEvent,
    now_ms: u64,
) -> Result<u16, (Option<u16>, String)> {
    if !delivery.allow_private {
        let url = reqwest::Url::parse(&event.url).map_err(|e| (None, e.to_string()))?;
        if let Some(refusal) = addresses::literal_refusal(&url) {
            return Err((None, format!("not sent: the URL {refusal}")));
        }
    }
    let mut secrets = vec![event.secret.as_str()];
    if let (Some(previous), Some(until_ms)) =
        (&event.previous_secret, event.previous_secret_until_ms)
        && now_ms < until_ms
    {
        secrets.push(previous);
    }
    let body = event.payload.as_bytes().to_vec();
    let answer = delivery
        .http
        .post(&event.url)
        .timeout(DELIVERY_TIMEOUT)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .header(EVENT_ID_HEADER, &event.event_id)
        .header(SIGNATURE_HEADER, signature_header(&secrets, now_ms, &body))
        .body(body)
        .send()
        .await
        .map_err(|error| (None, with_causes(&error)))?;
    let status = answer.status().as_u16();
    if answer.status().is_success() {
        Ok(status)
    } else {
        Err((Some(status), format!("answered {status}")))
    }
}

/// An error and its causes, outermost first: a client error alone says only that sending failed.
fn with_causes(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut cause = error.source();
    while let Some(inner) = cause {
        let inner_text = inner.to_string();
        if !text.contains(&inner_text) {
            text.push_str(": ");
            text.push_str(&inner_text);
        }
        cause = inner.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids() -> (TenantId, PoolId) {
        (
            TenantId::parse("acme").expect("tenant"),
            PoolId::parse("api").expect("pool"),
        )
    }

    #[test]
    fn a_threshold_is_reached_at_its_share_of_the_limit_and_not_before() {
        let reached_of = |granted, limit| reached(granted, limit, &[80, 100]).collect::<Vec<_>>();
        assert_eq!(reached_of(79, 100), Vec::<u8>::new());
        assert_eq!(reached_of(80, 100), [80]);
        assert_eq!(reached_of(100, 100), [80, 100]);
        // 80 % of 7 is 5.6: the sixth token reaches it.
        assert_eq!(reached_of(5, 7), Vec::<u8>::new());
        assert_eq!(reached_of(6, 7), [80]);
        assert_eq!(
            reached_of(0, 0),
            Vec::<u8>::new(),
            "a zero limit reaches nothing"
        );
        assert_eq!(reached_of(u64::MAX, u64::MAX), [80, 100], "no overflow");
    }

    #[test]
    fn an_event_id_names_what_it_is_about_and_nothing_else() {
        let (tenant, pool) = ids();
        let id = event_id("wh-1", &tenant, &pool, 60_000, 80);
        assert_eq!(id, event_id("wh-1", &tenant, &pool, 60_000, 80));
        assert_eq!(id.len(), 4 + 32);
        assert_ne!(id, event_id("wh-1", &tenant, &pool, 60_000, 100));
        assert_ne!(id, event_id("wh-1", &tenant, &pool, 120_000, 80));
        assert_ne!(id, event_id("wh-2", &tenant, &pool, 60_000, 80));
    }

    #[test]
    fn a_signature_is_the_hmac_of_the_timestamp_and_body_per_secret() {
        let header = signature_header(&["whsec_a", "whsec_b"], 1_700_000_000_000, b"{\"x\":1}");
        let parts: Vec<&str> = header.split(',').collect();
        assert_eq!(parts[0], "t=1700000000000");
        assert_eq!(parts.len(), 3, "{header}");
        let mut mac = <Hmac<Sha256> as KeyInit>::new_from_slice(b"whsec_a").expect("key");
        mac.update(b"1700000000000.{\"x\":1}");
        assert_eq!(
            parts[1],
            format!("v1={}", hex::encode(mac.finalize().into_bytes()))
        );
        assert_ne!(parts[1], parts[2], "each secret signs");
        assert_ne!(
            header,
            signature_header(&["whsec_a", "whsec_b"], 1_700_000_000_001, b"{\"x\":1}"),
            "the timestamp is signed"
        );
    }

    #[test]
    fn backoff_doubles_from_a_second_to_five_minutes() {
        assert_eq!(backoff_ms(1), 1_000);
        assert_eq!(backoff_ms(2), 2_000);
        assert_eq!(backoff_ms(5), 16_000);
        assert_eq!(backoff_ms(9), 256_000);
        assert_eq!(backoff_ms(10), MAX_BACKOFF_MS);
        assert_eq!(backoff_ms(u32::MAX), MAX_BACKOFF_MS);
        // From the first attempt to the last: 1 + 2 + ... + 256 s, then 5 minutes apart.
        let total: u64 = (1..MAX_ATTEMPTS).map(backoff_ms).sum();
        assert_eq!(total, 511_000 + 5 * MAX_BACKOFF_MS);
    }
}

//! Webhook registrations and their events (`migrations/0009_webhooks.sql`). An event row is both
//! the record that a crossing happened (its id dedupes it) and its delivery's state.

use allot_shared::ids::{PoolId, TenantId};

use super::{Database, Ledger, LedgerError, i64_of, u64_of};
use crate::webhooks::ThresholdEvent;

/// A registered webhook, secrets included (never answered by the API).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredWebhook {
    /// `wh-<hex>`.
    pub id: String,
    /// Where deliveries go (https).
    pub url: String,
    /// The tenant.
    pub tenant: TenantId,
    /// One pool, or every pool of the tenant.
    pub pool: Option<PoolId>,
    /// Thresholds, percent, ascending.
    pub thresholds_pct: Vec<u8>,
    /// The secret that signs.
    pub secret: String,
    /// The secret rotated out, still signing until [`StoredWebhook::previous_secret_until_ms`].
    pub previous_secret: Option<String>,
    /// Until when the previous secret signs, epoch ms.
    pub previous_secret_until_ms: Option<u64>,
    /// When it was registered, epoch ms.
    pub created_at_ms: u64,
    /// Who registered it.
    pub created_by: String,
}

/// An event due for delivery, with what delivering it needs.
#[derive(Debug, Clone)]
pub struct PendingEvent {
    /// The event.
    pub event_id: String,
    /// Its webhook.
    pub webhook_id: String,
    /// The body to send.
    pub payload: String,
    /// Attempts made so far.
    pub attempts: u32,
    /// Where to send it.
    pub url: String,
    /// The secret that signs.
    pub secret: String,
    /// The secret rotated out, if it still signs.
    pub previous_secret: Option<String>,
    /// Until when it does, epoch ms.
    pub previous_secret_until_ms: Option<u64>,
}

/// One event as the deliveries list shows it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct DeliveryView {
    /// The event.
    pub event_id: String,
    /// What it says.
    pub event: ThresholdEvent,
    /// `pending`, `delivered` or `failed`.
    pub state: String,
    /// Attempts made.
    pub attempts: u32,
    /// When it was found, epoch ms.
    pub created_at_ms: u64,
    /// When it was delivered, epoch ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delivered_at_ms: Option<u64>,
    /// When the next attempt is due, for a pending event, epoch ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_attempt_at_ms: Option<u64>,
    /// The endpoint's last status, if it answered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_status: Option<u16>,
    /// What went wrong last, if anything.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub last_error: Option<String>,
}

/// What recording an event did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventRecorded {
    /// A new event, queued for delivery.
    New,
    /// Recorded before (by this leader or another): nothing done.
    Known,
    /// The queue is full: not recorded.
    QueueFull,
}

#[derive(sqlx::FromRow)]
struct WebhookRow {
    id: String,
    url: String,
    tenant: String,
    pool: Option<String>,
    thresholds: String,
    secret: String,
    previous_secret: Option<String>,
    previous_secret_until_ms: Option<i64>,
    created_at_ms: i64,
    created_by: String,
}

impl WebhookRow {
    fn stored(self) -> Option<StoredWebhook> {
        Some(StoredWebhook {
            id: self.id,
            url: self.url,
            tenant: TenantId::parse(&self.tenant).ok()?,
            pool: match self.pool {
                Some(pool) => Some(PoolId::parse(&pool).ok()?),
                None => None,
            },
            thresholds_pct: self
                .thresholds
                .split(',')
                .filter_map(|t| t.parse().ok())
                .collect(),
            secret: self.secret,
            previous_secret: self.previous_secret,
            previous_secret_until_ms: self.previous_secret_until_ms.map(u64_of),
            created_at_ms: u64_of(self.created_at_ms),
            created_by: self.created_by,
        })
    }
}

#[derive(sqlx::FromRow)]
struct PendingRow {
    event_id: String,
    webhook_id: String,
    payload: String,
    attempts: i64,
    url: String,
    secret: String,
    previous_secret: Option<String>,
    previous_secret_until_ms: Option<i64>,
}

#[derive(sqlx::FromRow)]
struct DeliveryRow {
    event_id: String,
    payload: String,
    attempts: i64,
    created_at_ms: i64,
    next_attempt_at_ms: i64,
    delivered_at_ms: Option<i64>,
    failed_at_ms: Option<i64>,
    last_status: Option<i64>,
    last_error: Option<String>,
}

const WEBHOOK_COLUMNS: &str = "id, url, tenant, pool, thresholds, secret, previous_secret, \
                               previous_secret_until_ms, created_at_ms, created_by";

impl Ledger {
    /// Every registered webhook, by id.
    pub async fn webhooks(&self) -> Result<Vec<StoredWebhook>, LedgerError> {
        let sql = format!("SELECT {WEBHOOK_COLUMNS} FROM webhooks ORDER BY id");
        let rows: Vec<WebhookRow> =
            on_pool!(self, |pool| sqlx::query_as(&sql).fetch_all(pool).await?);
        Ok(rows.into_iter().filter_map(WebhookRow::stored).collect())
    }

    /// Registers `webhook` unless `max` are registered already; false when full.
    pub async fn insert_webhook(
        &self,
        webhook: &StoredWebhook,
        max: u64,
    ) -> Result<bool, LedgerError> {
        let thresholds = webhook
            .thresholds_pct
            .iter()
            .map(u8::to_string)
            .collect::<Vec<_>>()
            .join(",");
        let sql = format!(
            "INSERT INTO webhooks ({WEBHOOK_COLUMNS})
             SELECT $1, $2, $3, $4, $5, $6, NULL, NULL, $7, $8
             WHERE (SELECT COUNT(*) FROM webhooks) < $9"
        );
        let inserted = on_pool!(self, |pool| sqlx::query(&sql)
            .bind(&webhook.id)
            .bind(&webhook.url)
            .bind(webhook.tenant.as_str())
            .bind(webhook.pool.as_ref().map(PoolId::as_str))
            .bind(&thresholds)
            .bind(&webhook.secret)
            .bind(i64_of(webhook.created_at_ms))
            .bind(&webhook.created_by)
            .bind(i64_of(max))
            .execute(pool)
            .await?
            .rows_affected());
        Ok(inserted == 1)
    }

    /// Removes webhook `id` and its events; false when there is none.
    pub async fn delete_webhook(&self, id: &str) -> Result<bool, LedgerError> {
        let removed = on_pool!(self, |pool| {
            let mut transaction = pool.begin().await?;
            sqlx::query("DELETE FROM webhook_events WHERE webhook_id = $1")
                .bind(id)
                .execute(&mut *transaction)
                .await?;
            let removed = sqlx::query("DELETE FROM webhooks WHERE id = $1")
                .bind(id)
                .execute(&mut *transaction)
                .await?
                .rows_affected();
            transaction.commit().await?;
            removed
        });
        Ok(removed == 1)
    }

    /// Makes `secret` webhook `id`'s signing secret; the one it replaces signs beside it until
    /// `previous_until_ms`. False when there is no such webhook.
    pub async fn rotate_webhook_secret(
        &self,
        id: &str,
        secret: &str,
        previous_until_ms: u64,
    ) -> Result<bool, LedgerError> {
        let updated = on_pool!(self, |pool| sqlx::query(
            "UPDATE webhooks SET previous_secret = secret, previous_secret_until_ms = $1,
                                 secret = $2
             WHERE id = $3"
        )
        .bind(i64_of(previous_until_ms))
        .bind(secret)
        .bind(id)
        .execute(pool)
        .await?
        .rows_affected());
        Ok(updated == 1)
    }

    /// Records `event` for delivery (due now), once: a known id is left as it is, and nothing is
    /// recorded while `max_pending` events await delivery.
    pub async fn record_webhook_event(
        &self,
        event: &ThresholdEvent,
        now_ms: u64,
        max_pending: u64,
    ) -> Result<EventRecorded, LedgerError> {
        let payload = serde_json::to_string(event).unwrap_or_default();
        let sql = "INSERT INTO webhook_events
                (event_id, webhook_id, payload, created_at_ms, attempts, next_attempt_at_ms)
             SELECT $1, $2, $3, $4, 0, $4
             WHERE (SELECT COUNT(*) FROM webhook_events
                    WHERE delivered_at_ms IS NULL AND failed_at_ms IS NULL) < $5
             ON CONFLICT (event_id) DO NOTHING";
        let inserted = on_pool!(self, |pool| sqlx::query(sql)
            .bind(&event.event_id)
            .bind(&event.webhook_id)
            .bind(&payload)
            .bind(i64_of(now_ms))
            .bind(i64_of(max_pending))
            .execute(pool)
            .await?
            .rows_affected());
        if inserted == 1 {
            return Ok(EventRecorded::New);
        }
        let known: Option<(String,)> = on_pool!(self, |pool| sqlx::query_as(
            "SELECT event_id FROM webhook_events WHERE event_id = $1"
        )
        .bind(&event.event_id)
        .fetch_optional(pool)
        .await?);
        Ok(if known.is_some() {
            EventRecorded::Known
        } else {
            EventRecorded::QueueFull
        })
    }

    /// Up to `limit` events due by `now_ms`, oldest first, with their webhooks' endpoints.
    pub async fn due_webhook_events(
        &self,
        now_ms: u64,
        limit: u32,
    ) -> Result<Vec<PendingEvent>, LedgerError> {
        let sql = "SELECT e.event_id, e.webhook_id, e.payload, e.attempts, w.url, w.secret,
                          w.previous_secret, w.previous_secret_until_ms
                   FROM webhook_events e JOIN webhooks w ON w.id = e.webhook_id
                   WHERE e.delivered_at_ms IS NULL AND e.failed_at_ms IS NULL
                     AND e.next_attempt_at_ms <= $1
                   ORDER BY e.next_attempt_at_ms, e.event_id
                   LIMIT $2";
        let rows: Vec<PendingRow> = on_pool!(self, |pool| sqlx::query_as(sql)
            .bind(i64_of(now_ms))
            .bind(i64::from(limit))
            .fetch_all(pool)
            .await?);
        Ok(rows
            .into_iter()
            .map(|row| PendingEvent {
                event_id: row.event_id,
                webhook_id: row.webhook_id,
                payload: row.payload,
                attempts: u32::try_from(row.attempts).unwrap_or(u32::MAX),
                url: row.url,
                secret: row.secret,
                previous_secret: row.previous_secret,
                previous_secret_until_ms: row.previous_secret_until_ms.map(u64_of),
            })
            .collect())
    }

    /// How many events await delivery.
    pub async fn pending_webhook_events(&self) -> Result<u64, LedgerError> {
        let (count,): (i64,) = on_pool!(self, |pool| sqlx::query_as(
            "SELECT COUNT(*) FROM webhook_events
             WHERE delivered_at_ms IS NULL AND failed_at_ms IS NULL"
        )
        .fetch_one(pool)
        .await?);
        Ok(u64_of(count))
    }

    /// Marks `event_id` delivered after `attempts`, the endpoint having answered `status`.
    pub async fn webhook_event_delivered(
        &self,
        event_id: &str,
        attempts: u32,
        status: u16,
        now_ms: u64,
    ) -> Result<(), LedgerError> {
        let _updated = on_pool!(self, |pool| sqlx::query(
            "UPDATE webhook_events SET delivered_at_ms = $1, attempts = $2, last_status = $3,
                                       last_error = NULL
             WHERE event_id = $4"
        )
        .bind(i64_of(now_ms))
        .bind(i64::from(attempts))
        .bind(i64::from(status))
        .bind(event_id)
        .execute(pool)
        .await?
        .rows_affected());
        Ok(())
    }

    /// Records a failed attempt of `event_id`: tried again at `next_attempt_at_ms`, or given up
    /// at `failed_at_ms`.
    pub async fn webhook_event_failed(
        &self,
        event_id: &str,
        attempts: u32,
        status: Option<u16>,
        error: &str,
        next_attempt_at_ms: u64,
        failed_at_ms: Option<u64>,
    ) -> Result<(), LedgerError> {
        let error: String = error.chars().take(500).collect();
        let _updated = on_pool!(self, |pool| sqlx::query(
            "UPDATE webhook_events SET attempts = $1, last_status = $2, last_error = $3,
                                       next_attempt_at_ms = $4, failed_at_ms = $5
             WHERE event_id = $6"
        )
        .bind(i64::from(attempts))
        .bind(status.map(i64::from))
        .bind(&error)
        .bind(i64_of(next_attempt_at_ms))
        .bind(failed_at_ms.map(i64_of))
        .bind(event_id)
        .execute(pool)
        .await?
        .rows_affected());
        Ok(())
    }

    /// Webhook `id`'s latest `last` events, newest first.
    pub async fn webhook_deliveries(
        &self,
        id: &str,
        last: u32,
    ) -> Result<Vec<DeliveryView>, LedgerError> {
        let sql = "SELECT event_id, payload, attempts, created_at_ms, next_attempt_at_ms,
                          delivered_at_ms, failed_at_ms, last_status, last_error
                   FROM webhook_events WHERE webhook_id = $1
                   ORDER BY created_at_ms DESC, event_id DESC LIMIT $2";
        let rows: Vec<DeliveryRow> = on_pool!(self, |pool| sqlx::query_as(sql)
            .bind(id)
            .bind(i64::from(last))
            .fetch_all(pool)
            .await?);
        Ok(rows
            .into_iter()
            .filter_map(|row| {
                let state = match (row.delivered_at_ms, row.failed_at_ms) {
                    (Some(_), _) => "delivered",
                    (None, Some(_)) => "failed",
                    (None, None) => "pending",
                };
                Some(DeliveryView {
                    event: serde_json::from_str(&row.payload).ok()?,
                    event_id: row.event_id,
                    state: state.to_owned(),
                    attempts: u32::try_from(row.attempts).unwrap_or(u32::MAX),
                    created_at_ms: u64_of(row.created_at_ms),
                    delivered_at_ms: row.delivered_at_ms.map(u64_of),
                    next_attempt_at_ms: (state == "pending")
                        .then(|| u64_of(row.next_attempt_at_ms)),
                    last_status: row.last_status.and_then(|s| u16::try_from(s).ok()),
                    last_error: row.last_error,
                })
            })
            .collect())
    }

    /// Removes up to `limit` delivered or failed events found before `before_ms`; how many.
    pub async fn prune_webhook_events(
        &self,
        before_ms: u64,
        limit: u32,
    ) -> Result<u64, LedgerError> {
        let removed = on_pool!(self, |pool| sqlx::query(
            "DELETE FROM webhook_events WHERE event_id IN (
                 SELECT event_id FROM webhook_events
                 WHERE created_at_ms < $1
                   AND (delivered_at_ms IS NOT NULL OR failed_at_ms IS NOT NULL)
                 LIMIT $2)"
        )
        .bind(i64_of(before_ms))
        .bind(i64::from(limit))
        .execute(pool)
        .await?
        .rows_affected());
        Ok(removed)
    }
}

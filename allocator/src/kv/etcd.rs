//! [`Kv`] on etcd, through the etcd-client crate. Every call has a deadline; a call that misses it is
//! [`KvError::Unavailable`], whose write outcome the caller must treat as unknown.

use std::time::Duration;

use async_trait::async_trait;
use etcd_client::{
    Client, Compare as EtcdCompare, CompareOp, ConnectOptions, GetOptions, PutOptions, SortOrder,
    SortTarget, Txn, TxnOp, TxnOpResponse,
};

use super::{Compare, Kv, KvError, Op, TxnOutcome, Versioned};

/// Deadline of one etcd call.
pub const ETCD_CALL_TIMEOUT: Duration = Duration::from_secs(3);

/// The etcd store.
#[derive(Clone)]
pub struct EtcdKv {
    client: Client,
}

/// Classifies an etcd error. `lease` names the lease the call used, for `lease not found` answers.
fn classify(error: etcd_client::Error, lease: Option<i64>) -> KvError {
    let text = error.to_string();
    match lease {
        Some(id) if text.contains("lease not found") => KvError::LeaseNotFound(id),
        _ => KvError::Unavailable(text),
    }
}

/// Runs an etcd call under [`ETCD_CALL_TIMEOUT`].
pub(super) async fn within<T>(
    lease: Option<i64>,
    future: impl Future<Output = Result<T, etcd_client::Error>>,
) -> Result<T, KvError> {
    match tokio::time::timeout(ETCD_CALL_TIMEOUT, future).await {
        Ok(result) => result.map_err(|e| classify(e, lease)),
        Err(_) => Err(KvError::Unavailable(format!(
            "no answer from etcd within {ETCD_CALL_TIMEOUT:?}"
        ))),
    }
}

impl EtcdKv {
    /// Connects to the cluster at `endpoints` (e.g. `http://127.0.0.1:2379`). The client balances
    /// over all endpoints and fails over between them.
    pub async fn connect(endpoints: &[String]) -> Result<Self, KvError> {
        Ok(Self {
            client: connect_client(endpoints).await?,
        })
    }
}

/// A client of `endpoints` with every call under [`ETCD_CALL_TIMEOUT`] and keep-alives, so a
/// dead member is noticed within seconds.
pub(super) async fn connect_client(endpoints: &[impl AsRef<str>]) -> Result<Client, KvError> {
    let options = ConnectOptions::new()
        .with_connect_timeout(ETCD_CALL_TIMEOUT)
        .with_timeout(ETCD_CALL_TIMEOUT)
        .with_keep_alive(Duration::from_secs(2), Duration::from_secs(2));
    within(None, Client::connect(endpoints, Some(options))).await
}

impl EtcdKv {}

fn to_versioned(kv: &etcd_client::KeyValue) -> Versioned {
    Versioned {
        value: kv.value().to_vec(),
        mod_revision: kv.mod_revision(),
    }
}

/// A read's keys and their values, in the order etcd answered them.
fn keyed(response: &etcd_client::GetResponse) -> Vec<(String, Versioned)> {
    response
        .kvs()
        .iter()
        .map(|kv| {
            (
                String::from_utf8_lossy(kv.key()).into_owned(),
                to_versioned(kv),
            )
        })
        .collect()
}

impl EtcdKv {
    /// Up to `limit` keys under `prefix` (at most `MAX_PREFIX_KEYS`), in key order (`None`: etcd's
    /// own, ascending by key) or `Descend`.
    async fn read_prefix(
        &self,
        prefix: &str,
        limit: usize,
        order: SortOrder,
    ) -> Result<Vec<(String, Versioned)>, KvError> {
        let mut kv = self.client.kv_client();
        let limit = i64::try_from(limit.min(super::MAX_PREFIX_KEYS)).unwrap_or(i64::MAX);
        let mut options = GetOptions::new().with_prefix().with_limit(limit);
        if order != SortOrder::None {
            options = options.with_sort(SortTarget::Key, order);
        }
        let response = within(None, kv.get(prefix, Some(options))).await?;
        Ok(keyed(&response))
    }
}

#[async_trait]
impl Kv for EtcdKv {
    async fn get(&self, key: &str) -> Result<Option<Versioned>, KvError> {
        let mut kv = self.client.kv_client();
        let response = within(None, kv.get(key, None)).await?;
        Ok(response.kvs().first().map(to_versioned))
    }

    async fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Versioned>>, KvError> {
        if keys.len() > super::MAX_TXN_OPS {
            return Err(KvError::Refused(
                "too many operations in txn request".to_owned(),
            ));
        }
        let reads: Vec<TxnOp> = keys
            .iter()
            .map(|key| TxnOp::get(key.as_str(), None))
            .collect();
        let mut kv = self.client.kv_client();
        let response = within(None, kv.txn(Txn::new().and_then(reads))).await?;
        let values: Vec<Option<Versioned>> = response
            .op_responses()
            .into_iter()
            .map(|answer| match answer {
                TxnOpResponse::Get(read) => read.kvs().first().map(to_versioned),
                _ => None,
            })
            .collect();
        if values.len() != keys.len() {
            return Err(KvError::Unavailable(format!(
                "etcd answered {} of {} reads",
                values.len(),
                keys.len()
            )));
        }
        Ok(values)
    }

    async fn get_prefix_newest(
        &self,
        prefix: &str,
        limit: usize,
    ) -> Result<Vec<(String, Versioned)>, KvError> {
        self.read_prefix(prefix, limit, SortOrder::Descend).await
    }

    async fn get_prefix_after(
        &self,
        prefix: &str,
        after: &str,
        limit: usize,
    ) -> Result<Vec<(String, Versioned)>, KvError> {
        let mut kv = self.client.kv_client();
        let limit = i64::try_from(limit.min(super::MAX_PREFIX_KEYS)).unwrap_or(i64::MAX);
        // From just past `after` (its successor: the key with a zero byte appended) to the end of
        // the prefix's range (the prefix with its last byte raised).
        let start: Vec<u8> = if after.is_empty() || after < prefix {
            prefix.as_bytes().to_vec()
        } else {
            let mut successor = after.as_bytes().to_vec();
            successor.push(0);
            successor
        };
        let mut end = prefix.as_bytes().to_vec();
        if let Some(last) = end.last_mut() {
            *last = last.saturating_add(1);
        }
        let options = GetOptions::new()
            .with_range(end)
            .with_limit(limit)
            .with_sort(SortTarget::Key, SortOrder::Ascend);
        let response = within(None, kv.get(start, Some(options))).await?;
        Ok(keyed(&response))
    }

    async fn txn(&self, compares: Vec<Compare>, ops: Vec<Op>) -> Result<TxnOutcome, KvError> {
        super::check_txn(&compares, &ops)?;
        let compares: Vec<EtcdCompare> = compares
            .into_iter()
            .map(|c| match c {
                Compare::ModRevision { key, revision } => {
                    EtcdCompare::mod_revision(key, CompareOp::Equal, revision)
                }
                Compare::Value { key, value } => EtcdCompare::value(key, CompareOp::Equal, value),
            })
            .collect();
        let lease = ops.iter().find_map(|op| match op {
            Op::Put { lease, .. } => *lease,
            Op::Delete { .. } => None,
        });
        let ops: Vec<TxnOp> = ops
            .into_iter()
            .map(|op| match op {
                Op::Put { key, value, lease } => {
                    TxnOp::put(key, value, lease.map(|id| PutOptions::new().with_lease(id)))
                }
                Op::Delete { key } => TxnOp::delete(key, None),
            })
            .collect();
        let mut kv = self.client.kv_client();
        let response = within(lease, kv.txn(Txn::new().when(compares).and_then(ops))).await?;
        let revision = response.header().map_or(0, |h| h.revision());
        Ok(TxnOutcome {
            succeeded: response.succeeded(),
            revision,
        })
    }

    async fn grant_lease(&self, ttl_s: i64) -> Result<i64, KvError> {
        let mut lease = self.client.lease_client();
        Ok(within(None, lease.grant(ttl_s, None)).await?.id())
    }

    async fn keep_alive(&self, lease: i64) -> Result<i64, KvError> {
        let mut client = self.client.lease_client();
        let (mut keeper, mut stream) = within(Some(lease), client.keep_alive(lease)).await?;
        within(Some(lease), keeper.keep_alive()).await?;
        let answer = tokio::time::timeout(ETCD_CALL_TIMEOUT, stream.message())
            .await
            .map_err(|_| KvError::Unavailable("no keep-alive answer from etcd".to_owned()))?
            .map_err(|e| classify(e, Some(lease)))?
            .ok_or_else(|| KvError::Unavailable("keep-alive stream closed".to_owned()))?;
        match answer.ttl() {
            ttl if ttl > 0 => Ok(ttl),
            _ => Err(KvError::LeaseNotFound(lease)),
        }
    }

    async fn revoke(&self, lease: i64) -> Result<(), KvError> {
        let mut client = self.client.lease_client();
        match within(Some(lease), client.revoke(lease)).await {
            Ok(_) | Err(KvError::LeaseNotFound(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

//! How the Redis store's calls are sent: the decide library and the concurrency script, the call
//! itself under its deadline, loading again what the server lost (an unknown function or script
//! means nothing ran, so one reload and one retry cannot debit twice), and what a failure means
//! ([`StoreError`]). Shared by the store ([`super::redis_store`]) and the tasks that send coalesced
//! calls ([`super::coalescing`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, ErrorKind, FromRedisValue, RedisError, RedisResult, ServerErrorKind};

use super::scripts::{
    LIBRARY_VERSION_PLACEHOLDER, coalesced_call, lone_reply, reads_decision_id,
    repeated_key_refusal, reply_integers,
};
use super::store::{Rejection, StoreError};

/// A script's source and the SHA-1 that `EVALSHA` names it by.
#[derive(Debug)]
pub(super) struct Script {
    source: &'static str,
    sha: String,
}

impl Script {
    pub(super) fn new(source: &'static str) -> Self {
        Self {
            source,
            sha: redis::Script::new(source).get_hash().to_owned(),
        }
    }

    fn evalsha(&self, keys: &[&str], args: &[String]) -> Cmd {
        let mut cmd = redis::cmd("EVALSHA");
        cmd.arg(&self.sha).arg(keys.len()).arg(keys).arg(args);
        cmd
    }

    fn load(&self) -> Cmd {
        let mut cmd = redis::cmd("SCRIPT");
        cmd.arg("LOAD").arg(self.source);
        cmd
    }
}

/// The decide function library: its text with the version filled in, and the function's name.
#[derive(Debug)]
pub(super) struct Library {
    source: String,
    /// One request.
    function: String,
    /// Several requests of one slot, one after another ([`super::coalescing`]).
    many_function: String,
}

impl Library {
    pub(super) fn new(template: &str) -> Self {
        let sha = redis::Script::new(template).get_hash().to_owned();
        let version = &sha[..16];
        Self {
            source: template.replace(LIBRARY_VERSION_PLACEHOLDER, version),
            function: format!("allot_decide_{version}"),
            many_function: format!("allot_decide_many_{version}"),
        }
    }

    /// One request's `FCALL`, from its keys and arguments as [`super::scripts::decide_keys`] and
    /// [`super::scripts::decide_args`] build them. A request that keeps no decision record and has
    /// no sliding log goes without the record's key and the decision id, which the function reads
    /// for nothing else: two strings fewer for Redis to hand to Lua on every such call.
    pub(super) fn fcall(&self, keys: &[&str], args: &[String]) -> Cmd {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg(&self.function);
        match compact_layout(keys, args) {
            Some((rule_keys, header, rules)) => {
                cmd.arg(rule_keys.len())
                    .arg(rule_keys)
                    .arg(header)
                    .arg(rules);
            }
            None => {
                cmd.arg(keys.len()).arg(keys).arg(args);
            }
        }
        cmd
    }

    fn fcall_many(&self, keys: &[&str], args: &[String]) -> Cmd {
        let mut cmd = redis::cmd("FCALL");
        cmd.arg(&self.many_function)
            .arg(keys.len())
            .arg(keys)
            .arg(args);
        cmd
    }

    /// `FUNCTION LOAD` without `REPLACE`: a library of this name is this very text (the name
    /// carries its hash), so "already exists" is success.
    fn load(&self) -> Cmd {
        let mut cmd = redis::cmd("FUNCTION");
        cmd.arg("LOAD").arg(&self.source);
        cmd
    }
}

/// A lone request's rule keys, header and rules when it can go without its decision record's key
/// and its decision id (it keeps no record and has no sliding log); None otherwise, or when it is
/// not laid out as [`super::scripts::decide_keys`] and [`super::scripts::decide_args`] lay it.
fn compact_layout<'k, 'a>(
    keys: &'k [&'k str],
    args: &'a [String],
) -> Option<(&'k [&'k str], &'a String, &'a [String])> {
    let (header, rest) = args.split_first()?;
    let (_decision_id, rules) = rest.split_first()?;
    let (_record_key, rule_keys) = keys.split_first()?;
    let fits =
        !rules.is_empty() && rules.len() == rule_keys.len() && !reads_decision_id(header, rules);
    fits.then_some((rule_keys, header, rules))
}

/// Whether `error` says the library was loaded before (`FUNCTION LOAD` of a name that exists).
fn already_loaded(error: &RedisError) -> bool {
    error.to_string().contains("already exists")
}

/// Whether `error` is the reply to an `FCALL` of a function the server does not have: nothing ran.
fn function_missing(error: &RedisError) -> bool {
    error.code() == Some("ERR") && error.to_string().contains("Function not found")
}

/// What the store calls: the decide library's one-request function, its coalesced function, or a
/// script.
#[derive(Clone, Copy)]
pub(super) enum Code<'a> {
    Library(&'a Library),
    Coalesced(&'a Library),
    Script(&'a Script),
}

impl Code<'_> {
    fn call(&self, keys: &[&str], args: &[String]) -> Cmd {
        match self {
            Code::Library(library) => library.fcall(keys, args),
            Code::Coalesced(library) => library.fcall_many(keys, args),
            Code::Script(script) => script.evalsha(keys, args),
        }
    }

    fn load(&self) -> Cmd {
        match self {
            Code::Library(library) | Code::Coalesced(library) => library.load(),
            Code::Script(script) => script.load(),
        }
    }

    /// Whether `error` says the server does not have this code (it did not run).
    fn is_missing(&self, error: &RedisError) -> bool {
        match self {
            Code::Library(_) | Code::Coalesced(_) => function_missing(error),
            Code::Script(_) => error.kind() == ErrorKind::Server(ServerErrorKind::NoScript),
        }
    }

    fn name(&self) -> &str {
        match self {
            Code::Library(library) => &library.function,
            Code::Coalesced(library) => &library.many_function,
            Code::Script(script) => &script.sha,
        }
    }
}

/// The two topologies a store runs on. Both handles are cheap to clone and multiplex their calls
/// over shared connections.
#[derive(Clone)]
pub(crate) enum Connection {
    /// One Redis; reconnects by itself after a restart or failover.
    Single(ConnectionManager),
    /// A Redis Cluster; every call of a request goes to the node owning its tenant's slot.
    Cluster(ClusterConnection),
}

impl Connection {
    pub(crate) async fn query<T: FromRedisValue>(&mut self, cmd: &Cmd) -> RedisResult<T> {
        match self {
            Connection::Single(connection) => cmd.query_async(connection).await,
            Connection::Cluster(connection) => cmd.query_async(connection).await,
        }
    }

    /// Loads `code` where a call on `routing_key` runs: the one server, or the node owning the
    /// key's slot.
    async fn load_for(&mut self, code: Code<'_>, routing_key: &str) -> RedisResult<()> {
        let loaded = match self {
            Connection::Single(connection) => code
                .load()
                .query_async::<redis::Value>(connection)
                .await
                .map(drop),
            Connection::Cluster(connection) => {
                let node = Route::with_key(routing_key, SlotAddr::Master);
                let routing = RoutingInfo::SingleNode(SingleNodeRoutingInfo::SpecificNode(node));
                connection
                    .route_command(code.load(), routing)
                    .await
                    .map(drop)
            }
        };
        match loaded {
            Err(error) if already_loaded(&error) => Ok(()),
            other => other,
        }
    }

    /// Loads `code` on every server (when connecting).
    pub(super) async fn load_everywhere(&mut self, code: Code<'_>) -> RedisResult<()> {
        // On a cluster, SCRIPT LOAD and FUNCTION LOAD are routed to every master and succeed only
        // if all do.
        match self.query::<redis::Value>(&code.load()).await {
            Err(error) if already_loaded(&error) => Ok(()),
            other => other.map(drop),
        }
    }
}

/// What sending a call needs: shared by the store and the tasks that send coalesced calls.
pub(crate) struct Calls {
    pub(super) connection: Connection,
    pub(super) decide_library: Library,
    pub(super) concurrency_script: Script,
    pub(super) call_timeout: Duration,
    /// Replies saying the library or a script was unknown, answered by loading it again
    /// (telemetry and tests).
    pub(super) script_reloads: AtomicU64,
}

impl Calls {
    /// Runs `code` under the call deadline: the call, and after a reply saying the server does
    /// not have it, one load and one retry.
    pub(super) async fn run<T: FromRedisValue>(
        &self,
        code: Code<'_>,
        keys: &[&str],
        args: &[String],
    ) -> Result<T, StoreError> {
        let call = async {
            let mut connection = self.connection.clone();
            let command = code.call(keys, args);
            match connection.query::<T>(&command).await {
                Err(error) if code.is_missing(&error) => {
                    self.script_reloads.fetch_add(1, Ordering::Relaxed);
                    // Expected after a restart, a failover or a flush; frequent ones mean trouble.
                    tracing::warn!(name = %code.name(), "the limiter's Lua code was unknown: loading it again");
                    let routing_key = keys.first().copied().unwrap_or_default();
                    // Nothing ran, so neither a failed load nor the retry can double-debit.
                    connection
                        .load_for(code, routing_key)
                        .await
                        .map_err(|error| StoreError::NotExecuted {
                            detail: format!("reloading the limiter's Lua code: {error}"),
                        })?;
                    connection.query(&command).await.map_err(classify)
                }
                reply => reply.map_err(classify),
            }
        };
        tokio::time::timeout(self.call_timeout, call)
            .await
            .map_err(|_| StoreError::Ambiguous {
                detail: format!("no reply within {:?}", self.call_timeout),
            })?
    }

    /// One request's decision: its `KEYS` and `ARGV` as [`decide_keys`] and [`decide_args`] build
    /// them.
    pub(crate) async fn decide_one(
        &self,
        keys: &[&str],
        args: &[String],
    ) -> Result<Vec<i64>, StoreError> {
        let reply: redis::Value = self
            .run(Code::Library(&self.decide_library), keys, args)
            .await?;
        lone_reply(reply).map_err(|detail| StoreError::MalformedReply { detail })
    }

    /// Several requests of one slot in one call, decided one after another in this order; each
    /// reply, or why that request was refused. A request naming a key twice is refused here, as
    /// the lone function refuses it (a call sends each key once), and the others go together. The
    /// outer error is the call's (none of them ran, or all may have).
    pub(crate) async fn decide_many(
        &self,
        requests: &[(&[String], &[String])],
    ) -> Result<Vec<Result<Vec<i64>, StoreError>>, StoreError> {
        let refusals: Vec<Option<String>> = requests
            .iter()
            .map(|(keys, args)| repeated_key_refusal(keys, args))
            .collect();
        let sent: Vec<(&[String], &[String])> = requests
            .iter()
            .zip(&refusals)
            .filter(|(_, refusal)| refusal.is_none())
            .map(|(request, _)| *request)
            .collect();
        let mut replies = if sent.is_empty() {
            Vec::new()
        } else {
            self.decide_sent(&sent).await?
        }
        .into_iter();
        Ok(refusals
            .into_iter()
            .map(|refusal| match refusal {
                Some(detail) => Err(StoreError::Rejected {
                    kind: Rejection::InvalidArgument,
                    detail,
                }),
                // decide_sent answers each request it sent, in order.
                None => replies.next().unwrap_or_else(|| {
                    Err(StoreError::MalformedReply {
                        detail: "fewer replies than requests sent".to_owned(),
                    })
                }),
            })
            .collect())
    }

    /// `requests` (each naming every key once) in one coalesced call.
    async fn decide_sent(
        &self,
        requests: &[(&[String], &[String])],
    ) -> Result<Vec<Result<Vec<i64>, StoreError>>, StoreError> {
        let (keys, args) = coalesced_call(requests).map_err(|detail| StoreError::Rejected {
            kind: Rejection::InvalidArgument,
            detail,
        })?;
        let replies: Vec<redis::Value> = self
            .run(Code::Coalesced(&self.decide_library), &keys, &args)
            .await?;
        if replies.len() != requests.len() {
            return Err(StoreError::MalformedReply {
                detail: format!(
                    "{} replies to a coalesced call of {} requests",
                    replies.len(),
                    requests.len()
                ),
            });
        }
        Ok(replies.into_iter().map(coalesced_reply).collect())
    }
}

#[cfg(test)]
impl Calls {
    /// The coalesced function with raw `KEYS` and `ARGV`: for tests of its own validation. Each
    /// request's reply, or why it was refused.
    pub(crate) async fn decide_many_raw(
        &self,
        keys: &[&str],
        args: &[String],
    ) -> Result<Vec<Result<Vec<i64>, StoreError>>, StoreError> {
        let replies: Vec<redis::Value> = self
            .run(Code::Coalesced(&self.decide_library), keys, args)
            .await?;
        Ok(replies.into_iter().map(coalesced_reply).collect())
    }
}

/// One request's part of a coalesced reply: a lone call's reply (it starts with a digit), or the
/// text of its error (it starts with a letter; the library's contract), refused as a lone call's
/// error reply would be.
fn coalesced_reply(reply: redis::Value) -> Result<Vec<i64>, StoreError> {
    let redis::Value::BulkString(text) = reply else {
        return Err(StoreError::MalformedReply {
            detail: format!("a coalesced request's reply is not a string: {reply:?}"),
        });
    };
    if text.first().is_some_and(u8::is_ascii_digit) {
        return reply_integers(&text).map_err(|detail| StoreError::MalformedReply { detail });
    }
    let detail = String::from_utf8_lossy(&text).into_owned();
    let kind = detail
        .split_whitespace()
        .next()
        .and_then(refusal)
        .unwrap_or(Rejection::ScriptDefect);
    Err(StoreError::Rejected { kind, detail })
}

/// What an error code of our Lua code says was wrong with the call, when it names one: the
/// arguments, or the state under a key. Nothing was written.
fn refusal(code: &str) -> Option<Rejection> {
    match code {
        "ALLOT_ARG" => Some(Rejection::InvalidArgument),
        "ALLOT_STATE" | "WRONGTYPE" => Some(Rejection::StateMismatch),
        _ => None,
    }
}

/// Classifies a failed `EVALSHA` by what it tells about the script having run (module docs of
/// [`super::store`]).
pub(super) fn classify(error: RedisError) -> StoreError {
    let detail = error.to_string();
    if let Some(code) = error.code() {
        // The server answered with an error. Our scripts write only after every check and every
        // read, and Redis refuses a script's first write under memory pressure and never a later
        // one, so no error reply leaves a partial write behind.
        let rejected = |kind| StoreError::Rejected {
            kind,
            detail: detail.clone(),
        };
        if let Some(kind) = refusal(code) {
            return rejected(kind);
        }
        return match code {
            // A Lua runtime error, or keys in two slots: defects, not conditions to retry.
            "ERR" | "CROSSSLOT" => rejected(Rejection::ScriptDefect),
            // BUSY, LOADING, READONLY, OOM, MOVED, ASK, TRYAGAIN, CLUSTERDOWN, MASTERDOWN, NOSCRIPT
            // (twice), NOPERM...: the server did not run the script to a write.
            _ => StoreError::NotExecuted { detail },
        };
    }
    match error.kind() {
        ErrorKind::Io if error.is_connection_refusal() => StoreError::NotExecuted { detail },
        // Sent, or possibly sent: the script may have run.
        ErrorKind::Io => StoreError::Ambiguous { detail },
        ErrorKind::Parse | ErrorKind::UnexpectedReturnType => StoreError::MalformedReply { detail },
        ErrorKind::ClusterConnectionNotFound
        | ErrorKind::Client
        | ErrorKind::InvalidClientConfig
        | ErrorKind::AuthenticationFailed => StoreError::NotExecuted { detail },
        // Anything else: assume the worst that is safe.
        _ => StoreError::Ambiguous { detail },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn texts(items: &[&str]) -> Vec<String> {
        items.iter().map(|item| (*item).to_owned()).collect()
    }

    /// A request without a decision record or a sliding log goes without the record's key and
    /// the id; any other, and anything not laid out as a lone call, goes as it is.
    #[test]
    fn only_a_request_that_reads_no_id_goes_without_it() {
        let keys = ["{t:a}:d:1", "{t:a}:u", "{t:a}:t"];
        let plain = texts(&["0 0 2 0 0 0", "id-1", "tb 1 1 1 0 1", "fw 5 1000 0 0 1000"]);
        let (rule_keys, header, rules) = compact_layout(&keys, &plain).expect("compact");
        assert_eq!(rule_keys, &keys[1..]);
        assert_eq!(header, "0 0 2 0 0 0");
        assert_eq!(rules, &plain[2..]);
        let recorded = texts(&[
            "0 30000 2 0 0 0",
            "id-1",
            "tb 1 1 1 0 1",
            "fw 5 1000 0 0 1000",
        ]);
        assert!(compact_layout(&keys, &recorded).is_none());
        let sliding_log = texts(&["0 0 2 0 0 0", "id-1", "tb 1 1 1 0 1", "sl 5 1000 0 0 1000"]);
        assert!(compact_layout(&keys, &sliding_log).is_none());
        // Already without them (tests of the function's own refusals send such calls).
        assert!(compact_layout(&keys[1..2], &texts(&["0 0 1 0 0 0", "tb 1 1 1 0 1"])).is_none());
    }

    #[test]
    fn an_integer_reply_is_an_admission_by_the_one_rule() {
        assert_eq!(lone_reply(redis::Value::Int(7)), Ok(vec![1, 0, 0, 0, 0, 7]));
        let text = redis::Value::BulkString(b"0 1 250 0 0 0".to_vec());
        assert_eq!(lone_reply(text), Ok(vec![0, 1, 250, 0, 0, 0]));
        assert!(lone_reply(redis::Value::Nil).is_err());
        assert!(super::super::scripts::decide_reply_admits(
            &redis::Value::Int(0)
        ));
    }
}

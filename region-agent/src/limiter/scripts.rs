//! The Lua scripts and the Rust half of their contracts: how a batch or a lease call becomes
//! `KEYS`/`ARGV`, and how a reply becomes a decision. The contracts themselves are documented at the
//! top of each script (`scripts/decide.lua`, `scripts/concurrency.lua`); this module must follow them
//! field by field.

use std::collections::HashMap;
use std::fmt::Write as _;

use allot_shared::limit::RetryAfter;
use allot_shared::limit::multi::MAX_RULES_PER_REQUEST;

use super::batch::{RuleBatch, RuleParams};
use super::lua_inline;
use super::store::{BatchDecision, LeaseCall, LeaseOperation, LeaseOutcome};

/// The multi-rule decision function library as written, with `LIBRARY_VERSION` where its version
/// goes ([`crate::limiter::redis_store`] puts the first 16 hex digits of the loaded text's SHA-1
/// there). Each decision step is written once, marked for inlining: the store loads
/// [`decide_library`].
pub(crate) const DECIDE_SOURCE: &str = include_str!("scripts/decide.lua");

/// The decide library the store loads: `scripts/decide.lua` with its marked steps inlined at their
/// call sites (`lua_inline`), so that the paths that share a step pay no Lua call for it.
pub fn decide_library() -> String {
    lua_inline::expand(DECIDE_SOURCE).text
}

/// What [`DECIDE_SOURCE`] says where its version goes.
pub(crate) const LIBRARY_VERSION_PLACEHOLDER: &str = "LIBRARY_VERSION";

/// The concurrency-lease script.
pub(crate) const CONCURRENCY_SOURCE: &str = include_str!("scripts/concurrency.lua");

/// `ARGV[1]` of both scripts when the script must read the server's clock (`TIME`). Every production
/// call sends it; only tests send a time of their own.
pub(crate) const SERVER_TIME: u64 = 0;

/// Arguments before the first rule in the decide function's `ARGV`: the header (now, record TTL,
/// n, dry run, advisory mask, state layout, in one argument) and the decision id. Each rule is one
/// more.
const ARGS_BEFORE_RULES: usize = 2;

/// How the decide library writes a token bucket's, fixed window's or sliding counter's state. It
/// reads both layouts whichever it writes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum StateLayout {
    /// One string per key (`f<start> <count>`): one `GET` reads it, one `SET` writes it.
    #[default]
    Strings,
    /// The hashes agents wrote before the strings, which such agents need to read: for the length
    /// of a rolling upgrade from them (docs/operations.md).
    Hashes,
}

/// A sliding log's algorithm code in a rule text: the one rule the decision id matters to.
const SLIDING_LOG: &str = "sl";

/// Whether a header [`decide_args`] wrote keeps a decision record (its second field, the record's
/// TTL, is not 0).
fn keeps_record(header: &str) -> bool {
    header.split(' ').nth(1) != Some("0")
}

/// Whether a rule text [`decide_args`] wrote is a sliding log's.
fn is_sliding_log(rule: &str) -> bool {
    rule.split(' ').next() == Some(SLIDING_LOG)
}

/// Whether the decide library reads a request's decision id: for its decision record, or for a
/// sliding log's member. A request it does not read it for goes without the id (and without the
/// record's key), alone and in a coalesced call.
pub(crate) fn reads_decision_id(header: &str, rules: &[String]) -> bool {
    keeps_record(header) || rules.iter().any(|rule| is_sliding_log(rule))
}

/// The decide script's `KEYS`: the decision record, then one key per rule.
pub(crate) fn decide_keys(batch: &RuleBatch) -> Vec<&str> {
    std::iter::once(batch.record_key())
        .chain(batch.rules().iter().map(|rule| rule.key()))
        .collect()
}

/// The decide function's `ARGV` for `batch` at `now_ms` ([`SERVER_TIME`] in production): the
/// header, the decision id, then one argument per rule (`"<algorithm> <p1> <p2> <p3> <p4>
/// <cost>"`). The function validates each header and rule text once and keeps the result, so the
/// texts are what the same policy always sends.
pub(crate) fn decide_args(batch: &RuleBatch, now_ms: u64, layout: StateLayout) -> Vec<String> {
    let mut args = Vec::with_capacity(ARGS_BEFORE_RULES + batch.rules().len());
    args.push(format!(
        "{now_ms} {} {} {} {} {}",
        batch.record_ttl_ms(),
        batch.rules().len(),
        u8::from(batch.dry_run()),
        advisory_mask(batch),
        u8::from(layout == StateLayout::Hashes)
    ));
    args.push(batch.decision_id().to_string());
    for rule in batch.rules() {
        let (code, p1, p2, p3, p4) = match *rule.params() {
            RuleParams::TokenBucket {
                capacity_millitokens,
                refill_millitokens,
                period_ms,
                slack_ms,
            } => (
                "tb",
                capacity_millitokens,
                refill_millitokens,
                period_ms,
                slack_ms,
            ),
            RuleParams::Gcra {
                capacity_millitokens,
                refill_millitokens,
                period_ms,
            } => (
                "gcra",
                capacity_millitokens,
                refill_millitokens,
                period_ms,
                0,
            ),
            RuleParams::FixedWindow {
                limit_units,
                window_ms,
            } => ("fw", limit_units, window_ms, 0, 0),
            RuleParams::SlidingCounter {
                limit_units,
                window_ms,
            } => ("sc", limit_units, window_ms, 0, 0),
            RuleParams::SlidingLog {
                limit_units,
                window_ms,
            } => (SLIDING_LOG, limit_units, window_ms, 0, 0),
        };
        args.push(format!(
            "{code} {p1} {p2} {p3} {p4} {}",
            rule.cost_millitokens()
        ));
    }
    args
}

/// Why a request, given as a lone call's keys and arguments, cannot go in a coalesced call: it
/// names a key twice (a rule's key again, or its decision record's as a rule's), and a coalesced
/// call sends each key once. The text is the error the lone function answers for a rule key named
/// twice (`ALLOT_ARG`: refused for its arguments, nothing written), so that such a request is
/// refused alone, as a lone call would be, while the others of its call are decided.
pub(crate) fn repeated_key_refusal(keys: &[String], args: &[String]) -> Option<String> {
    let (record_key, rule_keys) = keys.split_first()?;
    if let Some(key) = rule_keys
        .iter()
        .enumerate()
        .find_map(|(i, key)| rule_keys[..i].contains(key).then_some(key))
    {
        return Some(format!("ALLOT_ARG rule key {key} appears twice"));
    }
    let keeps_record = args.first().is_some_and(|header| keeps_record(header));
    (keeps_record && rule_keys.contains(record_key))
        .then(|| format!("ALLOT_ARG the decision record key {record_key} is also a rule key"))
}

/// The coalesced function's `KEYS` and `ARGV` for `requests`, each given as a lone call's keys
/// and arguments ([`decide_keys`], [`decide_args`]), in order: every key once, every header and
/// rule text once, and a layout naming them once per run of requests that share it (the format is
/// documented at `decide_many` in `scripts/decide.lua`). A request's decision id is sent only when
/// the function can read it: for a sliding log, or a decision record. `Err` when a request is not
/// a lone call's layout (its keys are not its record's and one per rule), or names a key twice
/// ([`repeated_key_refusal`]: the caller refuses such a request before).
///
/// Long by design: it writes the wire format `decide_many` reads, and the key slots and text
/// indices it numbers while laying out one request are the numbers later requests refer back to;
/// kept together, the encoder reads against the Lua decoder in one place, and the numbering cannot
/// drift between pieces.
pub(crate) fn coalesced_call<'a>(
    requests: &[(&'a [String], &'a [String])],
) -> Result<(Vec<&'a str>, Vec<String>), String> {
    let mut keys: Vec<&'a str> = Vec::new();
    let mut key_slots: HashMap<&'a str, usize> = HashMap::new();
    let mut texts: Vec<&'a str> = Vec::new();
    let mut text_indices: HashMap<&'a str, usize> = HashMap::new();
    // Per request its layout and the decision id it sends.
    let mut layouts: Vec<(String, Option<&'a str>)> = Vec::with_capacity(requests.len());
    for (index, (request_keys, request_args)) in requests.iter().enumerate() {
        let (Some((header, rest)), Some((record_key, rule_keys))) =
            (request_args.split_first(), request_keys.split_first())
        else {
            return Err(format!(
                "request {} has no header or no record key",
                index + 1
            ));
        };
        let Some((decision_id, rules)) = rest.split_first() else {
            return Err(format!("request {} has no decision id", index + 1));
        };
        if rules.len() != rule_keys.len() {
            return Err(format!(
                "request {} has {} rules and {} rule keys",
                index + 1,
                rules.len(),
                rule_keys.len()
            ));
        }
        if let Some(refusal) = repeated_key_refusal(request_keys, request_args) {
            return Err(format!("request {}: {refusal}", index + 1));
        }
        let mut text_index = |text: &'a str| {
            let next = texts.len() + 1;
            *text_indices.entry(text).or_insert_with(|| {
                texts.push(text);
                next
            })
        };
        let keeps_record = keeps_record(header);
        let sends_id = reads_decision_id(header, rules);
        let mut layout = format!(
            "{} {}",
            text_index(header),
            if sends_id { 'i' } else { '-' }
        );
        // The keys this request takes are keys[first_taken..]: known to later requests.
        let first_taken = keys.len();
        let mut push_slot = |layout: &mut String, key: &'a str| match key_slots.get(key) {
            Some(slot) => {
                let _ = write!(layout, " {slot}");
            }
            None => {
                keys.push(key);
                layout.push_str(" n");
            }
        };
        if keeps_record {
            push_slot(&mut layout, record_key);
        } else {
            layout.push_str(" -");
        }
        for (rule, key) in rules.iter().zip(rule_keys) {
            let _ = write!(layout, " {}", text_index(rule));
            push_slot(&mut layout, key);
        }
        for (index, key) in keys.iter().enumerate().skip(first_taken) {
            // KEYS is 1-based in the function.
            key_slots.entry(key).or_insert(index + 1);
        }
        layouts.push((layout, sends_id.then_some(decision_id.as_str())));
    }
    let mut args = Vec::with_capacity(2 + texts.len() + 3 * layouts.len());
    args.push(requests.len().to_string());
    args.push(texts.len().to_string());
    args.extend(texts.iter().map(|text| (*text).to_owned()));
    for run in layouts.chunk_by(|(a, _), (b, _)| a == b) {
        args.push(run.len().to_string());
        args.push(run[0].0.clone());
        args.extend(run.iter().filter_map(|(_, id)| id.map(str::to_owned)));
    }
    Ok((keys, args))
}

/// The batch's advisory rules as the script's mask: bit `i` for rule `i` (0-based).
fn advisory_mask(batch: &RuleBatch) -> u64 {
    batch
        .rules()
        .iter()
        .enumerate()
        .filter(|(_, rule)| rule.advisory())
        .fold(0, |mask, (index, _)| mask | 1 << index)
}

/// The integers of the decide library's reply: one string of decimal integers, one space apart.
/// A lone call's reply as its integers: the reply text's (see [`reply_integers`]), or, for an
/// integer reply (a lone request admitted by its one rule), those of `1 0 0 0 0 <remaining>`.
pub(crate) fn lone_reply(reply: redis::Value) -> Result<Vec<i64>, String> {
    match reply {
        redis::Value::Int(remaining) => Ok(vec![1, 0, 0, 0, 0, remaining]),
        redis::Value::BulkString(text) => reply_integers(&text),
        other => Err(format!(
            "the reply is neither text nor an integer: {other:?}"
        )),
    }
}

/// Whether a lone call's reply admits the request, for benchmarks that call the library
/// themselves ([`crate::limiter::RedisStore::decide_command`]).
pub fn decide_reply_admits(reply: &redis::Value) -> bool {
    lone_reply(reply.clone()).is_ok_and(|fields| fields.first() == Some(&1))
}

pub(crate) fn reply_integers(reply: &[u8]) -> Result<Vec<i64>, String> {
    let text = std::str::from_utf8(reply).map_err(|_| "the reply is not text".to_owned())?;
    text.split(' ')
        .map(|field| {
            field
                .parse()
                .map_err(|_| format!("{field:?} in the reply {text:?} is not an integer"))
        })
        .collect()
}

/// Parses the decide library's reply
/// `allowed denied_by retry_ms replayed advisory_denied remaining...`, checking it against the
/// contract; the error says what broke it.
pub(crate) fn parse_decide_reply(
    batch: &RuleBatch,
    reply: &[i64],
) -> Result<BatchDecision, String> {
    let [
        allowed,
        denied_by,
        retry_ms,
        replayed,
        advisory_denied,
        remaining @ ..,
    ] = reply
    else {
        return Err(format!("{} fields, fewer than 6", reply.len()));
    };
    let count = batch.rules().len();
    let replayed = match replayed {
        0 => false,
        1 => true,
        other => return Err(format!("replayed = {other}")),
    };
    // A replay carries the recorded decision's rules, which may have been a different set.
    let expected_rules = if replayed {
        1..=MAX_RULES_PER_REQUEST
    } else {
        count..=count
    };
    if !expected_rules.contains(&remaining.len()) {
        return Err(format!(
            "{} remaining values for {count} rules",
            remaining.len()
        ));
    }
    let remaining = remaining
        .iter()
        .map(|&value| u64::try_from(value).map_err(|_| format!("remaining = {value}")))
        .collect::<Result<Vec<u64>, String>>()?;
    let retry = match *retry_ms {
        -1 => RetryAfter::Never,
        ms if ms >= 0 => RetryAfter::Ms(ms.unsigned_abs()),
        other => return Err(format!("retry = {other}")),
    };
    let denied_by = match (*allowed, usize::try_from(*denied_by)) {
        (1, Ok(0)) if retry == RetryAfter::Ms(0) => None,
        (0, Ok(index))
            if (1..=count).contains(&index) && retry != RetryAfter::Ms(0) && !replayed =>
        {
            Some(index - 1)
        }
        _ => {
            return Err(format!(
                "allowed = {allowed}, denied_by = {denied_by}, retry = {retry_ms}, replayed = {replayed}"
            ));
        }
    };
    // Only advisory rules may be named, and none in a replay.
    let advisory_denied = u64::try_from(*advisory_denied)
        .ok()
        .filter(|mask| mask & !advisory_mask(batch) == 0 && (*mask == 0 || !replayed))
        .ok_or_else(|| format!("advisory_denied = {advisory_denied}"))?;
    let advisory_denials = (0..count)
        .filter(|index| advisory_denied & (1 << index) != 0)
        .collect();
    Ok(BatchDecision {
        allowed: denied_by.is_none(),
        denied_by,
        advisory_denials,
        retry,
        remaining,
        replayed,
    })
}

/// The concurrency script's `ARGV` for `operation` at `now_ms` ([`SERVER_TIME`] in production).
pub(crate) fn lease_args(operation: LeaseOperation, call: &LeaseCall, now_ms: u64) -> Vec<String> {
    let name = match operation {
        LeaseOperation::Acquire => "acquire",
        LeaseOperation::Renew => "renew",
        LeaseOperation::Release => "release",
    };
    vec![
        name.to_owned(),
        now_ms.to_string(),
        call.lease_id().to_string(),
        call.max_in_flight().to_string(),
        call.lease_ttl_ms().to_string(),
    ]
}

/// Parses the concurrency script's reply `{held, in_flight}`.
pub(crate) fn parse_lease_reply(reply: &[i64]) -> Result<LeaseOutcome, String> {
    match *reply {
        [held @ (0 | 1), in_flight] if in_flight >= 0 => Ok(LeaseOutcome {
            held: held == 1,
            in_flight: in_flight.unsigned_abs(),
        }),
        _ => Err(format!("expected {{held, in_flight}}, got {reply:?}")),
    }
}

#[cfg(test)]
mod tests {
    use allot_shared::ids::{DecisionId, TenantId};

    use super::*;
    use crate::limiter::batch::BatchRule;

    fn batch() -> RuleBatch {
        let tenant = TenantId::parse("atlas").expect("tenant");
        let rules = vec![
            BatchRule::new(
                "rl:v1:{t:atlas}:u:1:read".to_owned(),
                RuleParams::TokenBucket {
                    capacity_millitokens: 20_000,
                    refill_millitokens: 2_000,
                    period_ms: 1_000,
                    slack_ms: 5_000,
                },
                1_000,
            )
            .expect("valid"),
            BatchRule::new(
                "rl:v1:{t:atlas}:tenant:atlas:*".to_owned(),
                RuleParams::SlidingLog {
                    limit_units: 20,
                    window_ms: 10_000,
                },
                1_000,
            )
            .expect("valid"),
        ];
        RuleBatch::new(
            &tenant,
            DecisionId::parse("r-7").expect("id"),
            30_000,
            rules,
        )
        .expect("valid")
    }

    #[test]
    fn arguments_follow_the_documented_layout() {
        let batch = batch();
        assert_eq!(
            decide_keys(&batch),
            [
                "rl:v1:{t:atlas}:d:r-7",
                "rl:v1:{t:atlas}:u:1:read",
                "rl:v1:{t:atlas}:tenant:atlas:*"
            ]
        );
        assert_eq!(
            decide_args(&batch, SERVER_TIME, StateLayout::Strings),
            [
                "0 30000 2 0 0 0",
                "r-7",
                "tb 20000 2000 1000 5000 1000",
                "sl 20 10000 0 0 1000",
            ]
        );
    }

    #[test]
    fn the_hash_layout_says_so_in_its_header() {
        let args = decide_args(&batch(), SERVER_TIME, StateLayout::Hashes);
        assert_eq!(args[0], "0 30000 2 0 0 1");
    }

    #[test]
    fn a_dry_run_says_so_in_its_header() {
        let args = decide_args(&batch().into_dry_run(), SERVER_TIME, StateLayout::Strings);
        assert_eq!(args[0], "0 30000 2 1 0 0");
        assert_eq!(args.len(), 2 + 2);
    }

    /// The function's name carries its text's version, so two agent versions never call each
    /// other's code; the text names no other version.
    #[test]
    fn the_library_is_named_after_its_text() {
        let name = format!("allot_decide_{LIBRARY_VERSION_PLACEHOLDER}");
        assert!(DECIDE_SOURCE.starts_with(&format!("#!lua name={name}\n")));
        assert!(DECIDE_SOURCE.contains(&format!("redis.register_function('{name}', decide)")));
    }

    /// Every call of a marked step is inlined: a call left would cost the path it is on a Lua
    /// call per rule, which is what writing each step once must not cost.
    #[test]
    fn every_marked_step_is_inlined_where_it_is_called() {
        let expanded = lua_inline::expand(DECIDE_SOURCE);
        assert!(expanded.refused.is_empty(), "{:?}", expanded.refused);
        assert!(expanded.calls_left.is_empty(), "{:?}", expanded.calls_left);
        // refilled, the two algorithms' steps, the plain step, what a plain rule has left and its
        // write, at each of their call sites: at least one each.
        assert!(expanded.inlined >= 6, "{}", expanded.inlined);
        for step in ["token_bucket_step", "fixed_window_step", "plain_step"] {
            assert!(DECIDE_SOURCE.contains(&format!("--@inline\nlocal function {step}(")));
        }
    }

    #[test]
    fn a_reply_is_decimal_integers_one_space_apart() {
        assert_eq!(
            reply_integers(b"0 2 -1 0 1 7 0").expect("valid"),
            [0, 2, -1, 0, 1, 7, 0]
        );
        for malformed in [&b""[..], b"1  0", b" 1", b"1 ", b"1 0x10", b"1\t0", b"\xff"] {
            assert!(reply_integers(malformed).is_err(), "{malformed:?}");
        }
    }

    #[test]
    fn replies_are_checked_against_the_contract() {
        let batch = batch();
        let allowed = parse_decide_reply(&batch, &[1, 0, 0, 0, 0, 19_000, 19]).expect("valid");
        assert!(allowed.allowed && !allowed.replayed);
        assert_eq!(allowed.remaining, [19_000, 19]);
        let denied = parse_decide_reply(&batch, &[0, 2, -1, 0, 0, 0, 0]).expect("valid");
        assert_eq!(
            (denied.denied_by, denied.retry),
            (Some(1), RetryAfter::Never)
        );
        let replay =
            parse_decide_reply(&batch, &[1, 0, 0, 1, 0, 5]).expect("a replay may differ in length");
        assert!(replay.replayed);
        for broken in [
            &[1, 0, 0, 0, 0, 19_000][..], // one remaining for two rules
            &[0, 0, 500, 0, 0, 0, 0],     // denied by nobody
            &[1, 1, 0, 0, 0, 0, 0],       // allowed and denied
            &[0, 3, 500, 0, 0, 0, 0],     // no rule 3
            &[0, 1, 0, 0, 0, 0, 0],       // a denial without a hint
            &[0, 1, -2, 0, 0, 0, 0],      // an impossible hint
            &[1, 0, 0, 0, 0, -1, 0],      // negative remaining
            &[1, 0, 0, 2, 0, 0, 0],       // replayed = 2
            &[1, 0, 0, 0, 1, 0, 0],       // an advisory denial by an enforced rule
            &[1, 0, 0, 0, -1, 0, 0],      // a negative mask
            &[1, 0, 0],                   // too short
        ] {
            assert!(parse_decide_reply(&batch, broken).is_err(), "{broken:?}");
        }
        // With rule 2 advisory, its denial is named.
        let advisory = {
            let mut rules = batch.rules().to_vec();
            rules[1] = rules[1].clone().into_advisory();
            RuleBatch::new(
                &allot_shared::ids::TenantId::parse("atlas").expect("tenant"),
                DecisionId::parse("r-8").expect("id"),
                0,
                rules,
            )
            .expect("valid")
        };
        assert_eq!(
            decide_args(&advisory, SERVER_TIME, StateLayout::Strings)[0],
            "0 0 2 0 2 0"
        );
        let flagged = parse_decide_reply(&advisory, &[1, 0, 0, 0, 2, 19_000, 0]).expect("valid");
        assert_eq!(flagged.advisory_denials, [1]);
        assert!(
            parse_decide_reply(&advisory, &[1, 0, 0, 1, 2, 19_000]).is_err(),
            "none in a replay"
        );
        assert_eq!(
            parse_lease_reply(&[1, 3]),
            Ok(LeaseOutcome {
                held: true,
                in_flight: 3
            })
        );
        assert!(parse_lease_reply(&[2, 3]).is_err());
        assert!(parse_lease_reply(&[1]).is_err());
    }

    fn strings(texts: &[&str]) -> Vec<String> {
        texts.iter().map(|text| (*text).to_owned()).collect()
    }

    /// A hot tenant's call: each key once, each text once, one layout per run of requests that
    /// share it; no decision id and no record key where the function cannot read them.
    #[test]
    fn a_coalesced_call_sends_what_its_requests_share_once() {
        let user = "tb 20000 2000 1000 5000 1000";
        let tenant = "tb 90000 9000 1000 0 1000";
        let log = "sl 20 10000 0 0 1000";
        let plain_header = "0 0 2 0 0 0";
        let recorded_header = "0 30000 2 0 0 0";
        let request = |user_key: &str, id: &str, header: &str, tenant_rule: &str| {
            (
                strings(&[&format!("{{t:a}}r:{id}"), user_key, "{t:a}tenant"]),
                strings(&[header, id, user, tenant_rule]),
            )
        };
        let owned = [
            request("{t:a}u:1", "d1", plain_header, tenant),
            request("{t:a}u:2", "d2", plain_header, tenant),
            request("{t:a}u:3", "d3", plain_header, tenant),
            request("{t:a}u:1", "d4", recorded_header, tenant),
            request("{t:a}u:4", "d5", plain_header, log),
        ];
        let requests: Vec<(&[String], &[String])> =
            owned.iter().map(|(k, a)| (&k[..], &a[..])).collect();
        let (keys, args) = coalesced_call(&requests).expect("lone layouts");
        assert_eq!(
            keys,
            [
                "{t:a}u:1",
                "{t:a}tenant",
                "{t:a}u:2",
                "{t:a}u:3",
                "{t:a}r:d4",
                "{t:a}u:4"
            ]
        );
        assert_eq!(
            args,
            strings(&[
                "5",
                "5",
                plain_header,
                user,
                tenant,
                recorded_header,
                log,
                // The first request takes its keys; the next two name the tenant's again.
                "1",
                "1 - - 2 n 3 n",
                "2",
                "1 - - 2 n 3 2",
                // A decision record: its key and the decision id are sent; the user's key is
                // the first request's.
                "1",
                "4 i n 2 1 3 2",
                "d4",
                // A sliding log reads the decision id.
                "1",
                "1 i - 2 n 5 2",
                "d5",
            ])
        );
    }

    /// A request naming a key twice is refused as the lone function refuses it (a rule key), or
    /// for its record key named as a rule's when it keeps a record; a coalesced call, which sends
    /// each key once, refuses it whole, and so does a request that is not a lone call's layout.
    #[test]
    fn a_request_naming_a_key_twice_cannot_be_coalesced_and_a_broken_one_refuses_the_call() {
        let rule = "tb 20000 2000 1000 5000 1000";
        let keys_twice = strings(&["{t:a}r:1", "{t:a}u:1", "{t:a}u:1"]);
        let args = strings(&["0 0 2 0 0 0", "d1", rule, rule]);
        assert_eq!(
            repeated_key_refusal(&keys_twice, &args).as_deref(),
            Some("ALLOT_ARG rule key {t:a}u:1 appears twice")
        );
        assert!(coalesced_call(&[(&keys_twice[..], &args[..])]).is_err());
        let record_as_rule = strings(&["{t:a}u:1", "{t:a}u:1", "{t:a}t"]);
        let recorded = strings(&["0 30000 2 0 0 0", "d1", rule, rule]);
        assert!(repeated_key_refusal(&record_as_rule, &recorded).is_some());
        // Without a record the record key is not sent, so it repeats nothing.
        assert_eq!(repeated_key_refusal(&record_as_rule, &args), None);
        let distinct = strings(&["{t:a}r:1", "{t:a}u:1", "{t:a}t"]);
        assert_eq!(repeated_key_refusal(&distinct, &recorded), None);
        let missing_key = strings(&["{t:a}r:1", "{t:a}u:1"]);
        assert!(coalesced_call(&[(&missing_key[..], &args[..])]).is_err());
        let no_id = strings(&["0 0 1 0 0 0"]);
        assert!(coalesced_call(&[(&missing_key[..], &no_id[..])]).is_err());
        assert!(coalesced_call(&[(&[][..], &args[..])]).is_err());
    }
}

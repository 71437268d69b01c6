//! Offline replay of recorded admission requests against a policy bundle.
//!
//! Before a bundle is rolled out, operators replay a sample of real traffic (the agents' decision log)
//! against it and against the current bundle, and compare the denial rate of every rule
//! (`allotctl policies replay`). The replay uses the same rule matching, keys and algorithms as the
//! data plane, with in-memory state and the sample's own timestamps. It covers the regional rate rules;
//! global (leased) rules and concurrency caps depend on other regions and on request durations, which a
//! sample does not record, and are reported as not replayed.
//!
//! Shadow and soft rules are replayed as they run (never denying; what they would deny is counted),
//! or, with [`ReplayOptions::enforce_advisory`], as if enforced: "if I enforce this bundle, who would
//! be denied?". The answer names who (the principals as the log has them: keyed hashes, most denied
//! first) and what the denied requests would no longer spend of global pools: quota leased for
//! them that ends its lease unspent (stranded) unless other requests spend it.

use std::collections::{BTreeMap, HashMap};

use serde::{Deserialize, Serialize};

use crate::contract::AdmissionRequest;
use crate::keys::{IpPrefixes, Pepper, principal_hash};
use crate::limit::multi::{RuleInput, State, decide_all};
use crate::policy::{Limit, PolicyBundle};

/// One recorded request: when it arrived and what it asked.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplaySample {
    /// Arrival time, epoch ms.
    pub at_ms: u64,
    /// The admission request.
    pub request: AdmissionRequest,
}

/// How one rule fared in a replay.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct RuleReplay {
    /// Requests the rule applied to.
    pub evaluated: u64,
    /// Requests it was the first to deny.
    pub denied: u64,
    /// For a shadow or soft rule: requests it would have denied (it denies none).
    #[serde(default)]
    pub would_deny: u64,
}

/// The outcome of a replay.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ReplayReport {
    /// Requests replayed.
    pub requests: u64,
    /// Requests denied by some regional rule.
    pub denied: u64,
    /// Per rule id.
    pub rules: BTreeMap<String, RuleReplay>,
    /// Rules that applied but are not replayed (global and concurrency), with how often they applied.
    pub not_replayed: BTreeMap<String, u64>,
    /// Distinct principals denied at least once.
    #[serde(default)]
    pub principals_denied: u64,
    /// The most denied principals (as the sample has them: keyed hashes), most first, at most
    /// [`MAX_TOP_DENIED`].
    #[serde(default)]
    pub top_denied: Vec<DeniedPrincipal>,
    /// Per global pool: tokens the denied requests would have spent from it, and will not. Leases
    /// sized for them end unspent (stranded) unless other requests spend them.
    #[serde(default)]
    pub unspent_global_tokens: BTreeMap<String, u64>,
}

/// Most principals a replay names in [`ReplayReport::top_denied`].
pub const MAX_TOP_DENIED: usize = 10;

/// A principal and how often the replay denied it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct DeniedPrincipal {
    /// The tenant.
    pub tenant: String,
    /// The principal as the sample has it (the decision log's keyed hash).
    pub principal: String,
    /// Requests denied.
    pub denied: u64,
}

/// How to replay.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplayOptions {
    /// Replay shadow and soft rules as if enforced.
    pub enforce_advisory: bool,
}

/// Replays `samples` (in time order) against `bundle`. `pepper` only needs to be stable within the
/// replay: keys never leave it.
pub fn replay(bundle: &PolicyBundle, samples: &[ReplaySample], pepper: &Pepper) -> ReplayReport {
    replay_with(bundle, samples, pepper, ReplayOptions::default())
}

/// [`replay`], with `options`.
///
/// Long by design: it is the data plane's admission step run once per sample, in the data plane's
/// order (match the rules, read their states, decide them all, write the states only when nothing
/// denied), with the report counted at each branch; split, the in-memory store and the report would
/// be threaded through every piece, and the order would be harder to hold against the data plane's.
pub fn replay_with(
    bundle: &PolicyBundle,
    samples: &[ReplaySample],
    pepper: &Pepper,
    options: ReplayOptions,
) -> ReplayReport {
    let mut report = ReplayReport::default();
    let mut store: HashMap<String, (State, u64)> = HashMap::new();
    let mut denied_principals: HashMap<(String, String), u64> = HashMap::new();
    for sample in samples {
        let request = &sample.request;
        let principal_type = request.principal.kind;
        let hash = principal_hash(
            pepper,
            principal_type,
            &request.principal.id,
            IpPrefixes::default(),
        );
        report.requests += 1;
        let tenant = &request.tenant_id;
        let global_rules = bundle.global_rules_for(tenant, &request.route_group, principal_type);
        for rule in &global_rules {
            *report.not_replayed.entry(rule.id.to_string()).or_default() += 1;
        }
        let rules = bundle.regional_rules_for(tenant, &request.route_group, principal_type);
        let mut keyed = Vec::new();
        for rule in rules {
            if rule.concurrency.is_some() {
                *report.not_replayed.entry(rule.id.to_string()).or_default() += 1;
            }
            if let (Limit::Regional(algorithm), Some(key)) =
                (&rule.limit, rule.key_for(tenant, principal_type, &hash))
            {
                let cost = rule
                    .cost_millitokens_for(request.cost_hint)
                    .unwrap_or(u64::MAX);
                keyed.push((rule, algorithm, key, cost));
            }
        }
        if keyed.is_empty() {
            continue;
        }
        let now_ms = sample.at_ms;
        let states: Vec<Option<State>> = keyed
            .iter()
            .map(|(_, _, key, _)| {
                store
                    .get(key)
                    .filter(|(_, expires_at_ms)| *expires_at_ms > now_ms)
                    .map(|(state, _)| state.clone())
            })
            .collect();
        let inputs: Vec<RuleInput<'_>> = keyed
            .iter()
            .zip(&states)
            .map(|((rule, algorithm, _, cost), state)| RuleInput {
                algorithm,
                state: state.as_ref(),
                cost_millitokens: *cost,
                advisory: rule.mode.is_advisory() && !options.enforce_advisory,
            })
            .collect();
        for (rule, ..) in &keyed {
            report
                .rules
                .entry(rule.id.to_string())
                .or_default()
                .evaluated += 1;
        }
        let Ok(decision) = decide_all(&inputs, now_ms, request.request_id.as_str()) else {
            // A cost outside the rule's bounds: the data plane answers POLICY_ERROR; count a denial
            // of the first rule so the operator sees it.
            report.denied += 1;
            if let Some((rule, ..)) = keyed.first() {
                report.rules.entry(rule.id.to_string()).or_default().denied += 1;
            }
            continue;
        };
        for index in &decision.advisory_denials {
            if let Some((rule, ..)) = keyed.get(*index) {
                report
                    .rules
                    .entry(rule.id.to_string())
                    .or_default()
                    .would_deny += 1;
            }
        }
        match decision.denied_by {
            Some(index) => {
                report.denied += 1;
                if let Some((rule, ..)) = keyed.get(index) {
                    report.rules.entry(rule.id.to_string()).or_default().denied += 1;
                }
                let who = (tenant.to_string(), request.principal.id.clone());
                *denied_principals.entry(who).or_default() += 1;
                for rule in global_rules.iter().filter(|rule| !rule.mode.is_advisory()) {
                    if let (Limit::Global(pool), Some(cost)) =
                        (&rule.limit, rule.cost_millitokens_for(request.cost_hint))
                    {
                        let tokens = (cost / crate::MILLITOKENS_PER_TOKEN).max(1);
                        let unspent = report
                            .unspent_global_tokens
                            .entry(pool.to_string())
                            .or_default();
                        *unspent = unspent.saturating_add(tokens);
                    }
                }
            }
            None => {
                for ((_, _, key, _), write) in keyed.iter().zip(decision.writes) {
                    if let Some(write) = write {
                        store.insert(key.clone(), (write.state, now_ms + write.ttl_ms));
                    }
                }
            }
        }
    }
    report.principals_denied = denied_principals.len() as u64;
    let mut most: Vec<((String, String), u64)> = denied_principals.into_iter().collect();
    most.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    report.top_denied = most
        .into_iter()
        .take(MAX_TOP_DENIED)
        .map(|((tenant, principal), denied)| DeniedPrincipal {
            tenant,
            principal,
            denied,
        })
        .collect();
    report
}

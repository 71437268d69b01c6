//! Offline replay of recorded admission requests against a policy bundle.
//!
//! Before a bundle is rolled out, operators replay a sample of real traffic (the agents' decision log)
//! against it and against the current bundle, and compare the denial rate of every rule
//! (`allotctl policies replay`). The replay uses the same rule matching, keys and algorithms as the
//! data plane, with in-memory state and the sample's own timestamps. It covers the regional rate rules;
//! global (leased) rules and concurrency caps depend on other regions and on request durations, which a
//! sample does not record, and are reported as not replayed.

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
}

/// Replays `samples` (in time order) against `bundle`. `pepper` only needs to be stable within the
/// replay: keys never leave it.
pub fn replay(bundle: &PolicyBundle, samples: &[ReplaySample], pepper: &Pepper) -> ReplayReport {
    let mut report = ReplayReport::default();
    let mut store: HashMap<String, (State, u64)> = HashMap::new();
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
        for rule in bundle.global_rules_for(tenant, &request.route_group, principal_type) {
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
                advisory: rule.mode.is_advisory(),
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
    report
}

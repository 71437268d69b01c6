//! The decision core, in nanoseconds per decision: token bucket, GCRA, three rules at once, and a
//! lease grant. The ceiling these are compared against is a no-op decision (reading the state and
//! returning it), measured in the same run.

use std::hint::black_box;

use allot_shared::ids::{Epoch, LeaseId, RegionId};
use allot_shared::lease::{GrantRequest, LeaseClamping, PoolConfig, grant};
use allot_shared::limit::gcra::{Gcra, GcraState};
use allot_shared::limit::multi::{Algorithm, RuleInput, State, decide_all};
use allot_shared::limit::token_bucket::{TokenBucket, TokenBucketState};
use criterion::{Criterion, criterion_group, criterion_main};

fn decisions(c: &mut Criterion) {
    let bucket = TokenBucket::new(20_000, 2_000, 1_000, 5_000).expect("valid");
    let state = TokenBucketState {
        tokens_millitokens: 10_000,
        updated_at_ms: 1_000_000,
    };
    c.bench_function("ceiling: copy the state", |b| {
        b.iter(|| black_box(*black_box(&state)))
    });
    c.bench_function("token bucket", |b| {
        b.iter(|| bucket.decide(black_box(Some(&state)), black_box(1_000_250), 1_000))
    });
    let gcra = Gcra::new(20_000, 2_000, 1_000).expect("valid");
    let gcra_state = GcraState { tat_ms: 1_005_000 };
    c.bench_function("gcra", |b| {
        b.iter(|| gcra.decide(black_box(Some(&gcra_state)), black_box(1_000_250), 1_000))
    });
    let rules = [
        Algorithm::TokenBucket(bucket),
        Algorithm::TokenBucket(
            TokenBucket::new(1_000_000, 1_000_000, 60_000, 5_000).expect("valid"),
        ),
        Algorithm::Gcra(gcra),
    ];
    let states = [
        State::TokenBucket(state),
        State::TokenBucket(TokenBucketState {
            tokens_millitokens: 640_000,
            updated_at_ms: 1_000_000,
        }),
        State::Gcra(gcra_state),
    ];
    c.bench_function("multi-rule (3 rules)", |b| {
        b.iter(|| {
            let inputs: Vec<RuleInput<'_>> = rules
                .iter()
                .zip(&states)
                .map(|(algorithm, state)| RuleInput {
                    algorithm,
                    state: Some(state),
                    cost_millitokens: 1_000,
                    advisory: false,
                })
                .collect();
            decide_all(black_box(&inputs), black_box(1_000_250), "r-1")
        })
    });
    let config = PoolConfig::new(
        1_000_000,
        60_000,
        100,
        15_000,
        100,
        vec![
            RegionId::parse("eu").expect("region"),
            RegionId::parse("us").expect("region"),
        ],
    )
    .expect("valid");
    let request = GrantRequest {
        lease_id: LeaseId::from_parts(1, 1),
        region: RegionId::parse("eu").expect("region"),
        want_tokens: 100,
    };
    c.bench_function("lease grant", |b| {
        b.iter(|| {
            grant(
                &config,
                None,
                Epoch(1),
                black_box(30_000),
                &request,
                LeaseClamping::Clamped,
            )
        })
    });
}

/// The store keys one request of three regional rules names (a user's, its route's and its
/// tenant's state, and the decision record), built as the agent builds them for every decision.
fn request_keys(c: &mut Criterion) {
    use allot_shared::contract::PrincipalType;
    use allot_shared::ids::{DecisionId, RouteGroup, TenantId};
    use allot_shared::keys::{
        IpPrefixes, Pepper, decision_key, principal_hash, principal_key, rule_state_key, tenant_key,
    };
    let pepper = Pepper::new(b"bench-pepper-0123456789".to_vec()).expect("long enough");
    let hash = principal_hash(&pepper, PrincipalType::User, "U-17", IpPrefixes::default());
    let tenant = TenantId::parse("atlas").expect("tenant");
    let route = RouteGroup::parse("read").expect("route");
    let decision = DecisionId::parse("r-9f3a61c2e07b4d18").expect("id");
    c.bench_function("request keys (3 rules and a record)", |b| {
        b.iter(|| {
            let user = principal_key(black_box(&tenant), PrincipalType::User, &hash, Some(&route));
            let route_key = tenant_key(black_box(&tenant), Some(&route));
            let tenant_wide = tenant_key(black_box(&tenant), None);
            [
                rule_state_key(&user, "tb"),
                rule_state_key(&route_key, "tb"),
                rule_state_key(&tenant_wide, "tb"),
                decision_key(black_box(&tenant), &decision),
            ]
        })
    });
}

criterion_group!(benches, decisions, request_keys);
criterion_main!(benches);

//! The limiter store over TLS: `rediss://` to a real TLS-enabled `redis-server`, trusting the CA
//! given, with a client certificate where the server demands one; refused otherwise.

use std::sync::Arc;

use allot_region_agent::clock::SystemClock;
use allot_region_agent::limiter::{Limiter, LimiterConfig, RedisStore, RedisStoreConfig, RedisTls};
use allot_region_agent::service::Agent;
use allot_testkit::{RedisServer, TestPki};

use crate::common;

const BUNDLE: &str = r#"{ "rules": [
    { "id": "user-read", "scope": "user", "routeGroup": "read", "algorithm": "fixed_window",
      "limit": 2, "windowMs": 3600000, "failMode": "closed" } ] }"#;

fn read(path: &std::path::Path) -> Vec<u8> {
    std::fs::read(path).expect("PEM file")
}

/// Two admitted and the third denied: the rule was decided by the store over TLS.
async fn decides_over(store: RedisStore) {
    let limiter = Limiter::new(Arc::new(store), LimiterConfig::default()).expect("limiter");
    let agent = Agent::new(
        common::settings(),
        Arc::new(SystemClock),
        limiter,
        None,
        Some(common::bundle(BUNDLE)),
    );
    let mut allowed = Vec::new();
    for n in 0..3 {
        let decision = agent
            .admit(&common::user_request(&format!("t-{n}"), "U-1", "read"))
            .await
            .expect("decision");
        assert!(!decision.fallback, "decided by the store: {decision:?}");
        allowed.push(decision.allowed);
    }
    assert_eq!(allowed, [true, true, false]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rediss_reaches_a_tls_server_trusting_the_ca_given() {
    let pki = TestPki::generate();
    let redis = RedisServer::start_tls(&pki, false);
    let tls = RedisTls {
        ca_pem: Some(read(&pki.ca())),
        client_pem: None,
    };
    let store = RedisStore::connect_with_tls(&redis.tls_url(), RedisStoreConfig::default(), &tls)
        .await
        .expect("connects over TLS");
    decides_over(store).await;
    // Without the CA, the system's roots do not vouch for the test server.
    let untrusted = RedisStore::connect(&redis.tls_url(), RedisStoreConfig::default()).await;
    assert!(untrusted.is_err(), "an unknown CA is refused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_demands_client_certificates_gets_one() {
    let pki = TestPki::generate();
    let redis = RedisServer::start_tls(&pki, true);
    let mutual = RedisTls {
        ca_pem: Some(read(&pki.ca())),
        client_pem: Some((read(&pki.client_cert()), read(&pki.client_key()))),
    };
    let store =
        RedisStore::connect_with_tls(&redis.tls_url(), RedisStoreConfig::default(), &mutual)
            .await
            .expect("connects with a client certificate");
    decides_over(store).await;
    let without = RedisTls {
        ca_pem: Some(read(&pki.ca())),
        client_pem: None,
    };
    let refused =
        RedisStore::connect_with_tls(&redis.tls_url(), RedisStoreConfig::default(), &without).await;
    assert!(refused.is_err(), "no client certificate, no connection");
}

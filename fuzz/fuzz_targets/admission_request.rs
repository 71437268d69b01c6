//! The admission request decoder: any bytes either fail to decode or validate, or yield a request
//! whose ids are within their charset and bounds (no `}` or `:` can reach a key), and that encodes
//! and decodes to itself.
#![no_main]

use allot_shared::contract::AdmissionRequest;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(request) = serde_json::from_slice::<AdmissionRequest>(data) else {
        return;
    };
    if request.validate().is_err() {
        return;
    }
    let tenant = request.tenant_id.as_str();
    assert!(!tenant.is_empty() && tenant.len() <= 32);
    assert!(tenant.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-'));
    assert!(!request.route_group.as_str().contains(['}', ':', '{']));
    assert!((1..=1 << 30).contains(&request.cost_hint));
    let encoded = serde_json::to_vec(&request).expect("encodes");
    let decoded: AdmissionRequest = serde_json::from_slice(&encoded).expect("decodes");
    assert_eq!(decoded, request);
});

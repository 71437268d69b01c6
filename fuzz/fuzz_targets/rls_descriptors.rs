//! Envoy RLS descriptor mapping: any descriptor either is refused naming its entry, or maps to an
//! admission request that validates.
#![no_main]

use allot_region_agent::grpc::admission_request;
use allot_region_agent::grpc::proto::envoy::extensions::common::ratelimit::v3::{
    RateLimitDescriptor, rate_limit_descriptor::Entry,
};
use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;

#[derive(Debug, Arbitrary)]
struct Input {
    entries: Vec<(String, String)>,
    descriptor_hits: Option<u64>,
    request_hits: u32,
}

fuzz_target!(|input: Input| {
    let descriptor = RateLimitDescriptor {
        entries: input
            .entries
            .into_iter()
            .map(|(key, value)| Entry { key, value })
            .collect(),
        hits_addend: input.descriptor_hits,
    };
    if let Ok(request) = admission_request(0, &descriptor, input.request_hits) {
        request
            .validate()
            .expect("a mapped descriptor is a valid admission request");
    }
});

//! The allocator API's OpenAPI document: valid by an outside validator, naming exactly the routes
//! and methods the router serves, and the running allocator (on a real etcd) held to it by
//! Schemathesis, once with an operator's token and once with a region agent's: every operation, bad
//! input included, no undocumented status, no 5xx but those documented, every answer as
//! documented, every call without a token refused.

use allot_allocator::http::openapi::document_json;
use allot_testkit::{EtcdCluster, SchemathesisRun};

use crate::common;

use crate::common::{AGENT, OPERATOR};

/// Where the allocator's contract is deliberately looser than its schemas can say.
const SCHEMATHESIS_CONFIG: &str = r#"
# A pool spec's rules across fields (chunk at most the limit, a lease shorter than the window,
# exactly one of windowMs and window, a time zone that exists) and a policy bundle's grammar (its
# own parser, docs/limiter.md) are checked past the schema: a schema-valid body may still be
# refused with 400 naming the field. Every other check still runs on these operations. An agent's
# status report is no bundle: its rules are each about one field, stated in the schema, so every
# schema-valid report must be accepted, and so must a bundle's version read by its path (1 to
# 2^53, the schema's bounds).
[[operations]]
include-path-regex = "^/v1/(pools|policies)"
exclude-path-regex = "^/v1/policies/(status|\\{version\\})$"
checks.positive_data_acceptance.enabled = false

# Tokens are minted from a role and, for agents only, a region: a pair the schema cannot tie.
[[operations]]
include-path = "/v1/tokens"
checks.positive_data_acceptance.enabled = false

# A webhook URL the schema's pattern admits may still not parse as a URL with a host.
[[operations]]
include-path-regex = "^/v1/webhooks"
checks.positive_data_acceptance.enabled = false

# An override names a pool or a rule (not both), and amounts that fit what it names; a rule
# must exist in the policy in force, a principal be named by its id or its hash.
[[operations]]
include-path = "/v1/overrides"
include-method = "POST"
checks.positive_data_acceptance.enabled = false

# A usage range must end after it starts, and a cursor needs the query it came from.
[[operations]]
include-path = "/v1/usage"
checks.positive_data_acceptance.enabled = false

# Reports, grants and runs name leases, windows and pools that must exist and agree (their rules
# about one field, such as `want` at least 1 and `reportId` 1 to 64 characters, are in the schema);
# a terms batch names a region the token must be allowed to act for.
[[operations]]
include-path-regex = "^/v1/(grants|reports|agent-sessions|terms)"
checks.positive_data_acceptance.enabled = false
"#;

#[test]
fn the_document_is_valid_and_names_every_route_and_only_routes() {
    allot_testkit::check_openapi_document(
        document_json(),
        include_str!("../../src/http/mod.rs"),
        30,
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_running_allocator_answers_as_its_document_says() {
    let etcd = EtcdCluster::single();
    let server = common::start_with(common::Options {
        etcd: etcd.endpoints(),
        ..Default::default()
    })
    .await;
    let schema_url = format!("{}/openapi.json", server.url);
    for token in [OPERATOR, AGENT] {
        let report = tokio::task::block_in_place(|| {
            allot_testkit::schemathesis(&SchemathesisRun {
                schema_url: &schema_url,
                authorization: &format!("Bearer {token}"),
                max_examples: 20,
                seed: 20_261_206,
                config: SCHEMATHESIS_CONFIG,
            })
        });
        assert!(report.contains("passed"), "{report}");
    }
}

/// Rules the allocator enforces about one field are stated in the schema, so a client generated
/// from it cannot send what is refused: `want` at least 1, `reportId` 1 to 64 characters, a
/// pepper fingerprint of 8 lowercase hex digits.
#[test]
fn the_schema_states_the_rules_about_one_field() {
    let document: serde_json::Value = serde_json::from_str(document_json()).expect("json");
    let property = |schema: &str, field: &str| {
        document["components"]["schemas"][schema]["properties"][field].clone()
    };
    assert_eq!(property("GrantBody", "want")["minimum"], 1);
    assert_eq!(property("Report", "reportId")["minLength"], 1);
    assert_eq!(property("Report", "reportId")["maxLength"], 64);
    let fingerprint = property("AgentStatus", "pepperFingerprint");
    assert_eq!(fingerprint["pattern"], "^[0-9a-f]{8}$", "{fingerprint}");
}

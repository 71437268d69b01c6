//! What Envoy's two services on the agent (rate limit, RLS, and rate limit quota, RLQS) share:
//! the gateway's identity from a call's metadata, and Envoy's key/value entries (a descriptor's, a
//! quota bucket id's) as an admission request, with their bounds.

use allot_shared::contract::{AdmissionRequest, Principal, PrincipalType};
use allot_shared::ids::{DecisionId, RouteGroup, TenantId};
use tonic::{Request, Status};

/// Most entries in one descriptor or bucket id (I10).
pub const MAX_ENTRIES: usize = 16;
/// Longest entry key or value, and longest domain, in bytes (I10).
pub const MAX_ENTRY_BYTES: usize = 256;
/// Largest request message, in bytes.
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024;
/// `method` when the entries name none.
pub const DEFAULT_METHOD: &str = "UNKNOWN";

/// Checks a gRPC call's `authorization: Bearer <gateway token>` metadata (RLS and RLQS alike).
pub fn authorize_gateway<T>(tokens: &[String], request: &Request<T>) -> Result<(), Status> {
    let token = request
        .metadata()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .unwrap_or_default();
    if crate::http::token_known(tokens, token) {
        Ok(())
    } else {
        Err(Status::unauthenticated(
            "send metadata authorization: Bearer <gateway token>",
        ))
    }
}

fn fresh_decision_id() -> DecisionId {
    // `rls-` and 32 hex digits: 36 characters of [a-z0-9-], always a valid decision id.
    DecisionId::parse(&format!("rls-{:032x}", rand::random::<u128>()))
        .expect("a fixed-shape decision id is valid")
}

/// An admission request from Envoy's key/value entries (a rate limit descriptor's, or a quota
/// bucket id's), mapped as [`crate::grpc`] documents; `fail(key, message)` is the error naming the entry
/// at fault (a cost hint out of range is named `hits_addend`).
pub fn request_from_entries<'e>(
    entries: impl Iterator<Item = (&'e str, &'e str)>,
    entry_count: usize,
    cost_hint: u64,
    fail: &dyn Fn(&str, &dyn std::fmt::Display) -> Status,
) -> Result<AdmissionRequest, Status> {
    if entry_count > MAX_ENTRIES {
        return Err(fail(
            "entries",
            &format_args!("at most {MAX_ENTRIES} entries"),
        ));
    }
    let mut tenant = None;
    let mut principal = None;
    let mut route_group = None;
    let mut method = None;
    for (key, value) in entries {
        if key.len() > MAX_ENTRY_BYTES || value.len() > MAX_ENTRY_BYTES {
            return Err(fail(
                "entries",
                &format_args!("keys and values are at most {MAX_ENTRY_BYTES} bytes"),
            ));
        }
        let slot_taken = match key {
            "tenant" => tenant.replace(value).is_some(),
            "user" => principal.replace((PrincipalType::User, value)).is_some(),
            "api_key" => principal.replace((PrincipalType::ApiKey, value)).is_some(),
            "remote_address" => principal.replace((PrincipalType::Ip, value)).is_some(),
            "route_group" => route_group.replace(value).is_some(),
            "method" => method.replace(value).is_some(),
            _ => false,
        };
        if slot_taken {
            return Err(fail(
                key,
                &"given twice (or more than one of user, api_key, remote_address)",
            ));
        }
    }
    let tenant = tenant.ok_or_else(|| fail("tenant", &"missing"))?;
    let tenant_id = TenantId::parse(tenant).map_err(|e| fail("tenant", &e))?;
    let (kind, id) =
        principal.ok_or_else(|| fail("user", &"missing one of user, api_key, remote_address"))?;
    let route_group = route_group.ok_or_else(|| fail("route_group", &"missing"))?;
    let route_group = RouteGroup::parse(route_group).map_err(|e| fail("route_group", &e))?;
    let request = AdmissionRequest {
        request_id: fresh_decision_id(),
        tenant_id,
        principal: Principal {
            kind,
            id: id.to_owned(),
            api_key_id: None,
        },
        route_group,
        method: method.unwrap_or(DEFAULT_METHOD).to_owned(),
        cost_hint,
        policy_epoch: None,
        dry_run: false,
        metered: false,
    };
    request.validate().map_err(|e| {
        let key = match e.field.as_str() {
            "principal.id" => "user",
            "costHint" => "hits_addend",
            other => other,
        };
        fail(key, &e.message)
    })?;
    Ok(request)
}

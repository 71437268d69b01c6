//! Who may call what: bearer tokens to credentials, roles, and agents' region scopes
//! ([`crate::auth`]).

use allot_shared::ids::RegionId;
use axum::http::{HeaderMap, StatusCode, header};

use super::ApiState;
use super::errors::ApiError;
use crate::auth::{Credential, Holder, OperatorRole};

/// What a handler needs of its caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Needs {
    /// An operator with at least this role.
    Operator(OperatorRole),
    /// A region agent.
    Agent,
    /// Any operator, or an agent.
    Reader,
}

fn bearer_token(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty())
}

/// Authenticates the caller and checks it may call an endpoint that `needs` what it names. An
/// unknown token and a missing one get the same 401: a caller learns nothing about which tokens exist.
pub fn authorize(
    state: &ApiState,
    headers: &HeaderMap,
    needs: Needs,
) -> Result<Credential, ApiError> {
    let credential = bearer_token(headers)
        .and_then(|token| state.tokens.authenticate(token))
        .ok_or_else(|| {
            metrics::counter!(crate::metrics::AUTH_REFUSALS, "status" => "401").increment(1);
            ApiError::new(
                StatusCode::UNAUTHORIZED,
                "Unauthorized",
                "send Authorization: Bearer <token>",
            )
        })?;
    let allowed = match (&credential.holder, needs) {
        (Holder::Operator(role), Needs::Operator(least)) => *role >= least,
        (Holder::Agent(_), Needs::Agent) => true,
        (_, Needs::Reader) => true,
        _ => false,
    };
    if !allowed {
        let detail = match needs {
            Needs::Operator(least) => format!(
                "this endpoint needs an operator token with role {} or above",
                least.as_str()
            ),
            Needs::Agent => "this endpoint needs an agent token".to_owned(),
            Needs::Reader => String::new(),
        };
        metrics::counter!(crate::metrics::AUTH_REFUSALS, "status" => "403").increment(1);
        return Err(ApiError::forbidden(detail));
    }
    Ok(credential)
}

/// Refuses an agent acting for a region its token is not scoped to. Operators may name any region
/// on the read endpoints that take one.
pub fn check_region(credential: &Credential, region: &RegionId) -> Result<(), ApiError> {
    if matches!(credential.holder, Holder::Agent(_)) && !credential.may_act_for(region) {
        return Err(ApiError::forbidden(format!(
            "this agent token may not act for region {region}"
        ))
        .with_field("region"));
    }
    Ok(())
}

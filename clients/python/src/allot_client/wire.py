"""The agent's wire messages, as its OpenAPI document defines them, and the rules on single fields
the client checks before it sends anything. ``tests/test_drift.py`` holds both equal to the running
agent's ``/openapi.json``: every TypedDict's fields and required fields, every rule's constraints."""

import re
from typing import Any, Literal, NotRequired, TypedDict


PrincipalType = Literal["user", "api_key", "ip"]
DeniedScope = Literal["user", "tenant", "route", "global", "concurrency"]


class Principal(TypedDict):
    type: PrincipalType
    id: str
    apiKeyId: NotRequired[str | None]


class AdmissionRequest(TypedDict):
    requestId: str
    tenantId: str
    principal: Principal
    routeGroup: str
    method: str
    costHint: NotRequired[int]
    policyEpoch: NotRequired[int | None]
    dryRun: NotRequired[bool]
    metered: NotRequired[bool]


class Violation(TypedDict):
    policyId: str
    mode: Literal["shadow", "soft"]
    scope: DeniedScope


class Decision(TypedDict):
    allowed: bool
    decisionId: str
    policyId: NotRequired[str | None]
    policyVersion: int
    deniedScope: NotRequired[DeniedScope | None]
    reason: NotRequired[str | None]
    limit: int
    remaining: int
    retryAfterMs: int
    fallback: bool
    dryRun: NotRequired[bool]
    violations: NotRequired[list[Violation]]
    settleByMs: NotRequired[int | None]


class SettleRequest(TypedDict):
    decisionId: str
    tenantId: str
    actualCost: int


class Charge(TypedDict):
    paid: int
    owed: int
    writtenOff: int


class PoolCharge(TypedDict):
    pool: str
    paid: int
    owed: int
    writtenOff: int


class SettleAnswer(TypedDict):
    decisionId: str
    estimate: int
    actualCost: int
    unused: int
    extra: int
    regional: Charge
    pools: NotRequired[list[PoolCharge]]
    replayed: NotRequired[bool]


class SlotRenewal(TypedDict):
    renewed: int
    lapsed: int
    failed: int


class QuotaLine(TypedDict):
    policyId: str
    scope: DeniedScope
    routeGroup: NotRequired[str | None]
    pool: NotRequired[str | None]
    limit: int
    remaining: NotRequired[int | None]
    windowMs: int
    resetMs: int
    fallback: bool
    ageMs: NotRequired[int | None]
    overrideId: NotRequired[str | None]


class QuotaStatus(TypedDict):
    tenantId: str
    policyVersion: int
    quotas: list[QuotaLine]


class Problem(TypedDict):
    type: str
    title: str
    status: int
    detail: str
    field: NotRequired[str | None]
    decisionId: NotRequired[str | None]


#: The messages held equal to the document's schemas of the same name.
MESSAGES: dict[str, type] = {
    cls.__name__: cls
    for cls in (
        Principal,
        AdmissionRequest,
        Violation,
        Decision,
        SettleRequest,
        Charge,
        PoolCharge,
        SettleAnswer,
        SlotRenewal,
        QuotaLine,
        QuotaStatus,
        Problem,
    )
}

#: The rules the client checks before sending, keyed ``Schema.field``.
FIELD_RULES: dict[str, dict[str, Any]] = {
    "AdmissionRequest.requestId": {"pattern": "^[A-Za-z0-9._-]{1,64}$", "minLength": 1, "maxLength": 64},
    "AdmissionRequest.tenantId": {"pattern": "^[a-z0-9-]{1,32}$", "minLength": 1, "maxLength": 32},
    "AdmissionRequest.routeGroup": {"pattern": "^[a-z0-9_-]{1,32}$", "minLength": 1, "maxLength": 32},
    "AdmissionRequest.method": {"pattern": "^[A-Z]{1,16}$"},
    "AdmissionRequest.costHint": {"minimum": 1, "maximum": 1073741824},
    "Principal.id": {"minLength": 1, "maxLength": 256},
    "Principal.apiKeyId": {"minLength": 1, "maxLength": 256},
    "SettleRequest.decisionId": {"pattern": "^[A-Za-z0-9._-]{1,64}$", "minLength": 1, "maxLength": 64},
    "SettleRequest.tenantId": {"pattern": "^[a-z0-9-]{1,32}$", "minLength": 1, "maxLength": 32},
    "SettleRequest.actualCost": {"minimum": 0, "maximum": 1073741824},
}


class FieldError(ValueError):
    """A message breaks the contract: ``field`` names the field at fault, as the agent would."""

    def __init__(self, field: str, why: str) -> None:
        super().__init__(f"{field}: {why}")
        self.field = field


def _check(key: str, value: Any, path: str) -> None:
    rule = FIELD_RULES[key]
    if "pattern" in rule or "maxLength" in rule:
        if not isinstance(value, str):
            raise FieldError(path, "must be a string")
        if len(value) < rule.get("minLength", 0):
            raise FieldError(path, f"must be at least {rule['minLength']} character(s)")
        if "maxLength" in rule and len(value) > rule["maxLength"]:
            raise FieldError(path, f"must be at most {rule['maxLength']} characters")
        # The whole value: `$` alone would let a trailing newline through.
        if "pattern" in rule and not re.fullmatch(rule["pattern"], value):
            raise FieldError(path, f"must match {rule['pattern']}")
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise FieldError(path, "must be a whole number")
    if value < rule["minimum"]:
        raise FieldError(path, f"must be at least {rule['minimum']}")
    if value > rule["maximum"]:
        raise FieldError(path, f"must be at most {rule['maximum']}")


def validate_admission(request: AdmissionRequest) -> None:
    """Checks an admission before it is sent; raises :class:`FieldError` naming the field."""
    for field in ("requestId", "tenantId", "routeGroup", "method"):
        _check(f"AdmissionRequest.{field}", request.get(field), field)
    _check("AdmissionRequest.costHint", request.get("costHint", 1), "costHint")
    principal = request.get("principal")
    if not isinstance(principal, dict):
        raise FieldError("principal", "must be an object")
    _check("Principal.id", principal.get("id"), "principal.id")
    if principal.get("apiKeyId") is not None:
        _check("Principal.apiKeyId", principal.get("apiKeyId"), "principal.apiKeyId")
    if request.get("metered") and request.get("dryRun"):
        raise FieldError(
            "metered",
            "a dry run spends nothing, so there is nothing to settle: send one of metered and dryRun",
        )


def validate_settlement(settlement: SettleRequest) -> None:
    """Checks a settlement before it is sent."""
    for field in ("decisionId", "tenantId", "actualCost"):
        _check(f"SettleRequest.{field}", settlement.get(field), field)


def validate_quota_query(tenant_id: str, principal_id: str, route_group: str | None) -> None:
    """Checks a quota query before it is sent."""
    _check("AdmissionRequest.tenantId", tenant_id, "tenantId")
    _check("Principal.id", principal_id, "principalId")
    if route_group is not None:
        _check("AdmissionRequest.routeGroup", route_group, "routeGroup")

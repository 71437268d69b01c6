// The agent's wire messages, as its OpenAPI document defines them (src/agent-api.ts, generated),
// and the rules on single fields the client checks before it sends anything.
import type { components } from "./agent-api.js";

type Schemas = components["schemas"];

export type AdmissionRequest = Schemas["AdmissionRequest"];
export type Decision = Schemas["Decision"];
export type Principal = Schemas["Principal"];
export type PrincipalType = Schemas["PrincipalType"];
export type Problem = Schemas["Problem"];
export type QuotaQuery = {
  tenantId: string;
  principalType: PrincipalType;
  principalId: string;
  routeGroup?: string;
};
export type QuotaStatus = Schemas["QuotaStatus"];
export type QuotaLine = Schemas["QuotaLine"];
export type SettleRequest = Schemas["SettleRequest"];
export type SettleAnswer = Schemas["SettleAnswer"];
export type SlotRenewal = Schemas["SlotRenewal"];

/** A rule on one field of a message, as the agent's schema states it. */
export interface FieldRule {
  pattern?: string;
  minLength?: number;
  maxLength?: number;
  minimum?: number;
  maximum?: number;
}

/**
 * The rules the client checks before sending, keyed `Schema.field` (a nested field's schema by its
 * own name). The drift test holds each equal to the running agent's `/openapi.json`.
 */
export const FIELD_RULES: Record<string, FieldRule> = {
  "AdmissionRequest.requestId": { pattern: "^[A-Za-z0-9._-]{1,64}$", minLength: 1, maxLength: 64 },
  "AdmissionRequest.tenantId": { pattern: "^[a-z0-9-]{1,32}$", minLength: 1, maxLength: 32 },
  "AdmissionRequest.routeGroup": { pattern: "^[a-z0-9_-]{1,32}$", minLength: 1, maxLength: 32 },
  "AdmissionRequest.method": { pattern: "^[A-Z]{1,16}$" },
  "AdmissionRequest.costHint": { minimum: 1, maximum: 1073741824 },
  "Principal.id": { minLength: 1, maxLength: 256 },
  "Principal.apiKeyId": { minLength: 1, maxLength: 256 },
  "SettleRequest.decisionId": { pattern: "^[A-Za-z0-9._-]{1,64}$", minLength: 1, maxLength: 64 },
  "SettleRequest.tenantId": { pattern: "^[a-z0-9-]{1,32}$", minLength: 1, maxLength: 32 },
  "SettleRequest.actualCost": { minimum: 0, maximum: 1073741824 },
};

/** Why a message breaks the contract: the field at fault, as the agent would name it. */
export class FieldError extends Error {
  constructor(
    readonly field: string,
    why: string,
  ) {
    super(`${field}: ${why}`);
    this.name = "FieldError";
  }
}

function check(rule: FieldRule, field: string, value: unknown): void {
  if (typeof value === "string") {
    const length = [...value].length;
    if (rule.minLength !== undefined && length < rule.minLength) {
      throw new FieldError(field, `must be at least ${rule.minLength} character(s)`);
    }
    if (rule.maxLength !== undefined && length > rule.maxLength) {
      throw new FieldError(field, `must be at most ${rule.maxLength} characters`);
    }
    if (rule.pattern !== undefined && !new RegExp(rule.pattern, "u").test(value)) {
      throw new FieldError(field, `must match ${rule.pattern}`);
    }
    return;
  }
  if (typeof value === "number") {
    if (!Number.isSafeInteger(value)) throw new FieldError(field, "must be a whole number");
    if (rule.minimum !== undefined && value < rule.minimum) {
      throw new FieldError(field, `must be at least ${rule.minimum}`);
    }
    if (rule.maximum !== undefined && value > rule.maximum) {
      throw new FieldError(field, `must be at most ${rule.maximum}`);
    }
    return;
  }
  throw new FieldError(field, `must be a ${rule.pattern || rule.maxLength ? "string" : "number"}`);
}

function checkField(schema: string, field: string, value: unknown, path = field): void {
  const rule = FIELD_RULES[`${schema}.${field}`];
  if (rule) check(rule, path, value);
}

/** Checks an admission before it is sent; throws a {@link FieldError} naming the field. */
export function validateAdmission(request: AdmissionRequest): void {
  for (const field of ["requestId", "tenantId", "routeGroup", "method"] as const) {
    checkField("AdmissionRequest", field, request[field]);
  }
  checkField("AdmissionRequest", "costHint", request.costHint ?? 1);
  if (typeof request.principal !== "object" || request.principal === null) {
    throw new FieldError("principal", "must be an object");
  }
  checkField("Principal", "id", request.principal.id, "principal.id");
  if (request.principal.apiKeyId !== undefined && request.principal.apiKeyId !== null) {
    checkField("Principal", "apiKeyId", request.principal.apiKeyId, "principal.apiKeyId");
  }
  if (request.metered && request.dryRun) {
    throw new FieldError(
      "metered",
      "a dry run spends nothing, so there is nothing to settle: send one of metered and dryRun",
    );
  }
}

/** Checks a settlement before it is sent. */
export function validateSettlement(request: SettleRequest): void {
  for (const field of ["decisionId", "tenantId", "actualCost"] as const) {
    checkField("SettleRequest", field, request[field]);
  }
}

/** Checks a quota query before it is sent. */
export function validateQuotaQuery(query: QuotaQuery): void {
  checkField("AdmissionRequest", "tenantId", query.tenantId, "tenantId");
  checkField("Principal", "id", query.principalId, "principalId");
  if (query.routeGroup !== undefined) {
    checkField("AdmissionRequest", "routeGroup", query.routeGroup, "routeGroup");
  }
}

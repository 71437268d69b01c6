// The region agent's wire types, generated from its OpenAPI document by openapi-typescript.
// Do not edit: run `npm run generate` against an agent (the drift test fails when this differs).
export interface paths {
    "/healthz": {
        parameters: {
            query?: never;
            header?: never;
            path?: never;
            cookie?: never;
        };
        /** Liveness. */
        get: operations["healthz"];
        put?: never;
        post?: never;
        delete?: never;
        options?: never;
        head?: never;
        patch?: never;
        trace?: never;
    };
    "/metrics": {
        parameters: {
            query?: never;
            header?: never;
            path?: never;
            cookie?: never;
        };
        /** Prometheus metrics. */
        get: operations["metrics_text"];
        put?: never;
        post?: never;
        delete?: never;
        options?: never;
        head?: never;
        patch?: never;
        trace?: never;
    };
    "/openapi.json": {
        parameters: {
            query?: never;
            header?: never;
            path?: never;
            cookie?: never;
        };
        /** This API's OpenAPI document. */
        get: operations["openapi_json"];
        put?: never;
        post?: never;
        delete?: never;
        options?: never;
        head?: never;
        patch?: never;
        trace?: never;
    };
    "/readyz": {
        parameters: {
            query?: never;
            header?: never;
            path?: never;
            cookie?: never;
        };
        /** Readiness: ready once a policy bundle is in force. */
        get: operations["readyz"];
        put?: never;
        post?: never;
        delete?: never;
        options?: never;
        head?: never;
        patch?: never;
        trace?: never;
    };
    "/v1/admit": {
        parameters: {
            query?: never;
            header?: never;
            path?: never;
            cookie?: never;
        };
        get?: never;
        put?: never;
        /** Decides a request; the decision is the answer, whatever it says. */
        post: operations["admit"];
        delete?: never;
        options?: never;
        head?: never;
        patch?: never;
        trace?: never;
    };
    "/v1/auth-request": {
        parameters: {
            query?: never;
            header?: never;
            path?: never;
            cookie?: never;
        };
        /**
         * `GET /v1/auth-request`: for nginx's `auth_request`, which knows three answers only: 2xx
         *     lets the request through, 401 and 403 refuse it with that status, and anything else is an
         *     error (nginx answers 500). So an admission answers 204; a denial answers 403 with the status
         *     the caller should see in `X-Allot-Status` (429 or 503) beside `Retry-After`, which the shipped
         *     configuration (`deploy/nginx/`) turns into that answer. The request comes from `X-Allot-*`
         *     headers only (nginx sends no body), as for [`check`]. A wrong gateway token still answers 401
         *     and bad input 400: the configuration maps both to errors, never to an admission.
         */
        get: operations["auth_request"];
        put?: never;
        post?: never;
        delete?: never;
        options?: never;
        head?: never;
        patch?: never;
        trace?: never;
    };
    "/v1/check": {
        parameters: {
            query?: never;
            header?: never;
            path?: never;
            cookie?: never;
        };
        get?: never;
        put?: never;
        /**
         * Decides a request and answers as a proxy should: 200, or the caller's refusal. The request may
         *     come as `X-Allot-*` headers instead of a body (see `/v1/auth-request`).
         */
        post: operations["check"];
        delete?: never;
        options?: never;
        head?: never;
        patch?: never;
        trace?: never;
    };
    "/v1/quota": {
        parameters: {
            query?: never;
            header?: never;
            path?: never;
            cookie?: never;
        };
        /** The caller's own quotas and what is left of them (only the rules it may see). */
        get: operations["quota"];
        put?: never;
        post?: never;
        delete?: never;
        options?: never;
        head?: never;
        patch?: never;
        trace?: never;
    };
    "/v1/release": {
        parameters: {
            query?: never;
            header?: never;
            path?: never;
            cookie?: never;
        };
        get?: never;
        put?: never;
        /** Gives back the concurrency slots a finished request holds (idempotent). */
        post: operations["release"];
        delete?: never;
        options?: never;
        head?: never;
        patch?: never;
        trace?: never;
    };
    "/v1/renew": {
        parameters: {
            query?: never;
            header?: never;
            path?: never;
            cookie?: never;
        };
        get?: never;
        put?: never;
        /** Extends the concurrency slots a running request holds (a heartbeat). */
        post: operations["renew"];
        delete?: never;
        options?: never;
        head?: never;
        patch?: never;
        trace?: never;
    };
    "/v1/settle": {
        parameters: {
            query?: never;
            header?: never;
            path?: never;
            cookie?: never;
        };
        get?: never;
        put?: never;
        /** States the actual cost of a metered admission (idempotent by decision id). */
        post: operations["settle"];
        delete?: never;
        options?: never;
        head?: never;
        patch?: never;
        trace?: never;
    };
}
export type webhooks = Record<string, never>;
export interface components {
    schemas: {
        /** @description The admission request a gateway sends for every request. */
        AdmissionRequest: {
            /**
             * Format: u-int64
             * @description Cost in whole units (default 1); a policy may override it per route group.
             */
            costHint?: number;
            /**
             * @description Decide without spending: the answer says what a real request would get now, and nothing is
             *     debited anywhere (no regional write, no lease spent, no fallback claimed, no concurrency
             *     slot taken).
             */
            dryRun?: boolean;
            /**
             * @description Charge `costHint` now as an estimate and the actual cost later (`POST /v1/settle` with the
             *     decision id, within the agent's settle window): for costs known only after the response
             *     (model tokens, bytes, rows). Unsettled, the estimate stands.
             */
            metered?: boolean;
            /** @description The HTTP method, for logs and matching. */
            method: string;
            /**
             * Format: u-int64
             * @description The policy bundle version the gateway evaluated against, if it tracks one.
             */
            policyEpoch?: number | null;
            /** @description The verified principal. */
            principal: components["schemas"]["Principal"];
            /** @description Minted at ingress and stable across retries: the idempotency scope of the decision. */
            requestId: components["schemas"]["DecisionId"];
            /** @description The route group the request maps to, e.g. `read`. */
            routeGroup: components["schemas"]["RouteGroup"];
            /** @description The verified tenant. */
            tenantId: components["schemas"]["TenantId"];
        };
        /**
         * @description The mode of a rule that advises instead of denying.
         * @enum {string}
         */
        AdvisoryMode: "shadow" | "soft";
        /** @description How one limit took a settlement's extra cost. */
        Charge: {
            /**
             * Format: u-int64
             * @description Owed: the next admissions pay it first.
             */
            owed: number;
            /**
             * Format: u-int64
             * @description Charged at once.
             */
            paid: number;
            /**
             * Format: u-int64
             * @description Beyond the debt the limit may carry: not charged, counted in metrics and the ledger.
             */
            writtenOff: number;
        };
        /** @description The decision: a structured record first, an HTTP response second. */
        Decision: {
            /** @description Whether the request may proceed. */
            allowed: boolean;
            /** @description The request's id, echoed. */
            decisionId: components["schemas"]["DecisionId"];
            deniedScope?: null | components["schemas"]["DeniedScope"];
            /** @description True when the request was a dry run: nothing was spent, whatever `allowed` says. */
            dryRun?: boolean;
            /** @description True when the decision was made without the shared store (a bounded local fallback). */
            fallback: boolean;
            /**
             * Format: u-int64
             * @description The attributed rule's limit, in whole units (internal; exposure to clients is separate).
             */
            limit: number;
            /** @description The rule the decision is attributed to (the denying rule, or the most constraining one). */
            policyId?: string | null;
            /**
             * Format: u-int64
             * @description The policy bundle version the decision was made against.
             */
            policyVersion: number;
            reason?: null | components["schemas"]["Reason"];
            /**
             * Format: u-int64
             * @description What is left of it, in whole units.
             */
            remaining: number;
            /**
             * Format: int64
             * @description When to retry in ms; 0 when allowed; -1 when the request can never succeed.
             */
            retryAfterMs: number;
            /**
             * Format: u-int64
             * @description A metered admission: settle its actual cost (`POST /v1/settle`) before this instant, epoch
             *     ms; unsettled, the estimate stands.
             */
            settleByMs?: number | null;
            /** @description The shadow and soft rules that would have denied the request (they deny nothing). */
            violations?: components["schemas"]["Violation"][];
        };
        DecisionId: string;
        /**
         * @description Which rule said no.
         * @enum {string}
         */
        DeniedScope: "user" | "tenant" | "route" | "global" | "concurrency";
        /** @description How one global pool took a settlement's extra cost, tokens. */
        PoolCharge: {
            /**
             * Format: u-int64
             * @description Owed: paid first from the region's next leases.
             */
            owed: number;
            /**
             * Format: u-int64
             * @description Charged at once from the region's leases.
             */
            paid: number;
            /** @description The pool. */
            pool: components["schemas"]["PoolId"];
            /**
             * Format: u-int64
             * @description Beyond `settleDebtPerRegion`: not charged, counted in metrics and the ledger.
             */
            writtenOff: number;
        };
        PoolId: string;
        /** @description Who the request is from, derived by the gateway from verified credentials only. */
        Principal: {
            /** @description The API key the request came with, if any. */
            apiKeyId?: string | null;
            /** @description The identity (user id, or the client address for `ip`). Never stored raw: keys hold its HMAC. */
            id: string;
            /** @description The identity kind. */
            type: components["schemas"]["PrincipalType"];
        };
        /**
         * @description The kind of verified identity a request carries.
         * @enum {string}
         */
        PrincipalType: "user" | "api_key" | "ip";
        /** @description An RFC 9457 problem details body. */
        Problem: {
            /** @description The decision this problem belongs to, when there is one. */
            decisionId?: string | null;
            /** @description What happened, for a human. */
            detail: string;
            /** @description The request field at fault, when there is one (e.g. `rules[2].capacityMillis`). */
            field?: string | null;
            /**
             * Format: u-int16
             * @description The HTTP status.
             */
            status: number;
            /** @description A short summary of the problem type. */
            title: string;
            /** @description A URI naming the problem type; `about:blank` when the status says it all. */
            type: string;
        } & {
            [key: string]: unknown;
        };
        /** @description One quota as its caller may see it. */
        QuotaLine: {
            /**
             * Format: u-int64
             * @description For a global pool: how old the allocator's figure is, ms. The pool's remaining is what the
             *     allocator had left to grant then, plus what this region holds unspent; other regions may
             *     have spent some of theirs since.
             */
            ageMs?: number | null;
            /** @description Decided from the region's bounded local fallback, not the shared store. */
            fallback: boolean;
            /**
             * Format: u-int64
             * @description The limit in whole units (a token bucket's capacity, a window's limit, a pool's `G`).
             */
            limit: number;
            overrideId?: null | components["schemas"]["RecordId"];
            /** @description The rule's id. */
            policyId: string;
            pool?: null | components["schemas"]["PoolId"];
            /**
             * Format: u-int64
             * @description What is left now, in whole units; `null` when it cannot be known now (the store is
             *     unavailable, or this region has not heard from the allocator in the pool's current window).
             */
            remaining?: number | null;
            /**
             * Format: u-int64
             * @description When the whole limit is available again, ms from now, at the latest.
             */
            resetMs: number;
            routeGroup?: null | components["schemas"]["RouteGroup"];
            /** @description Whose budget it is (`user`, `route`, `tenant` or `global`). */
            scope: components["schemas"]["DeniedScope"];
            /**
             * Format: u-int64
             * @description The window the limit is stated over, ms (a rate rule's: its time to refill from empty).
             */
            windowMs: number;
        };
        /** @description The answer to `GET /v1/quota`: the caller's own quotas, only those its rules let it see. */
        QuotaStatus: {
            /**
             * Format: u-int64
             * @description The policy bundle version the rules come from.
             */
            policyVersion: number;
            /** @description One line per visible rule, in evaluation order (regional, then global). */
            quotas: components["schemas"]["QuotaLine"][];
            /** @description The tenant asked about. */
            tenantId: components["schemas"]["TenantId"];
        };
        /**
         * @description Why a request was not admitted.
         * @enum {string}
         */
        Reason: "RATE_EXCEEDED" | "CONCURRENCY_EXCEEDED" | "LIMITER_UNAVAILABLE" | "POLICY_ERROR" | "COST_TOO_HIGH";
        /** Format: uuid */
        RecordId: string;
        RouteGroup: string;
        /**
         * @description The answer to `POST /v1/settle`.
         *
         *     An actual cost below the estimate gives nothing back (`unused`; no refunds). Above it, the
         *     difference (`extra`) is charged at once where it fits; what does not fit becomes debt that the
         *     next admissions pay first (`owed`), up to a bound; beyond it, it is written off and counted.
         */
        SettleAnswer: {
            /**
             * Format: u-int64
             * @description The actual cost, whole units.
             */
            actualCost: number;
            /** @description The admission settled. */
            decisionId: components["schemas"]["DecisionId"];
            /**
             * Format: u-int64
             * @description The estimate charged at admission, whole units.
             */
            estimate: number;
            /**
             * Format: u-int64
             * @description `actualCost - estimate` when positive: what was charged now or owed.
             */
            extra: number;
            /** @description How each global pool took it, in tokens. */
            pools?: components["schemas"]["PoolCharge"][];
            /** @description How the regional rules took the extra cost. */
            regional: components["schemas"]["Charge"];
            /** @description True when this decision id was settled before: the answer is that settlement's. */
            replayed?: boolean;
            /**
             * Format: u-int64
             * @description `estimate - actualCost` when positive: spent all the same.
             */
            unused: number;
        };
        /**
         * @description `POST /v1/settle`: the actual cost of a metered admission, once the response is known.
         *     Idempotent by decision id: the same body again gets the same answer.
         */
        SettleRequest: {
            /**
             * Format: u-int64
             * @description What the request actually cost, whole units, in `[0, 2^30]`.
             */
            actualCost: number;
            /** @description The metered admission's decision id (its `requestId`). */
            decisionId: components["schemas"]["DecisionId"];
            /** @description The tenant it was admitted for. */
            tenantId: components["schemas"]["TenantId"];
        };
        /** @description The answer to `POST /v1/renew`: what a heartbeat did to the concurrency slots of a request. */
        SlotRenewal: {
            /**
             * Format: u-int32
             * @description Slots the store could not be asked about (they lapse with their TTL unless a later
             *     heartbeat reaches them).
             */
            failed: number;
            /**
             * Format: u-int32
             * @description Slots that had lapsed (or were never held): not taken again.
             */
            lapsed: number;
            /**
             * Format: u-int32
             * @description Slots extended by their lease TTL.
             */
            renewed: number;
        };
        TenantId: string;
        /** @description A shadow or soft rule that would have denied a request. */
        Violation: {
            /** @description How it acts: `shadow` (the caller is not told) or `soft` (the caller is). */
            mode: components["schemas"]["AdvisoryMode"];
            /** @description The rule. */
            policyId: string;
            /** @description Whose budget it limits. */
            scope: components["schemas"]["DeniedScope"];
        };
    };
    responses: never;
    parameters: never;
    requestBodies: never;
    headers: never;
    pathItems: never;
}
export type $defs = Record<string, never>;
export interface operations {
    healthz: {
        parameters: {
            query?: never;
            header?: never;
            path?: never;
            cookie?: never;
        };
        requestBody?: never;
        responses: {
            /** @description Alive */
            200: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "text/plain": string;
                };
            };
        };
    };
    metrics_text: {
        parameters: {
            query?: never;
            header?: never;
            path?: never;
            cookie?: never;
        };
        requestBody?: never;
        responses: {
            /** @description The Prometheus text format */
            200: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "text/plain": string;
                };
            };
            /** @description No metrics registry in this process */
            404: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": components["schemas"]["Problem"];
                };
            };
        };
    };
    openapi_json: {
        parameters: {
            query?: never;
            header?: never;
            path?: never;
            cookie?: never;
        };
        requestBody?: never;
        responses: {
            /** @description The OpenAPI 3.1 document */
            200: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/json": Record<string, never>;
                };
            };
        };
    };
    readyz: {
        parameters: {
            query?: never;
            header?: never;
            path?: never;
            cookie?: never;
        };
        requestBody?: never;
        responses: {
            /** @description Ready, and the policy version */
            200: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "text/plain": string;
                };
            };
            /** @description No policy bundle yet */
            503: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": components["schemas"]["Problem"];
                };
            };
        };
    };
    admit: {
        parameters: {
            query?: never;
            header?: never;
            path?: never;
            cookie?: never;
        };
        requestBody: {
            content: {
                "application/json": components["schemas"]["AdmissionRequest"];
            };
        };
        responses: {
            /** @description The decision, allowed or not */
            200: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/json": components["schemas"]["Decision"];
                };
            };
            /** @description Bad input: problem+json naming the field (in the body, the query or a header) at fault. */
            400: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": {
                        /** @description The decision this problem belongs to, when there is one. */
                        decisionId?: string | null;
                        /** @description What happened, for a human. */
                        detail: string;
                        /** @description The request field at fault, when there is one (e.g. `rules[2].capacityMillis`). */
                        field?: string | null;
                        /**
                         * Format: u-int16
                         * @description The HTTP status.
                         */
                        status: number;
                        /** @description A short summary of the problem type. */
                        title: string;
                        /** @description A URI naming the problem type; `about:blank` when the status says it all. */
                        type: string;
                    } & {
                        [key: string]: unknown;
                    };
                };
            };
            /** @description No gateway token, or an unknown one. */
            401: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": {
                        /** @description The decision this problem belongs to, when there is one. */
                        decisionId?: string | null;
                        /** @description What happened, for a human. */
                        detail: string;
                        /** @description The request field at fault, when there is one (e.g. `rules[2].capacityMillis`). */
                        field?: string | null;
                        /**
                         * Format: u-int16
                         * @description The HTTP status.
                         */
                        status: number;
                        /** @description A short summary of the problem type. */
                        title: string;
                        /** @description A URI naming the problem type; `about:blank` when the status says it all. */
                        type: string;
                    } & {
                        [key: string]: unknown;
                    };
                };
            };
            /** @description The body is larger than 16 KiB. */
            413: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": {
                        /** @description The decision this problem belongs to, when there is one. */
                        decisionId?: string | null;
                        /** @description What happened, for a human. */
                        detail: string;
                        /** @description The request field at fault, when there is one (e.g. `rules[2].capacityMillis`). */
                        field?: string | null;
                        /**
                         * Format: u-int16
                         * @description The HTTP status.
                         */
                        status: number;
                        /** @description A short summary of the problem type. */
                        title: string;
                        /** @description A URI naming the problem type; `about:blank` when the status says it all. */
                        type: string;
                    } & {
                        [key: string]: unknown;
                    };
                };
            };
            /** @description The body is not `application/json`. */
            415: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": {
                        /** @description The decision this problem belongs to, when there is one. */
                        decisionId?: string | null;
                        /** @description What happened, for a human. */
                        detail: string;
                        /** @description The request field at fault, when there is one (e.g. `rules[2].capacityMillis`). */
                        field?: string | null;
                        /**
                         * Format: u-int16
                         * @description The HTTP status.
                         */
                        status: number;
                        /** @description A short summary of the problem type. */
                        title: string;
                        /** @description A URI naming the problem type; `about:blank` when the status says it all. */
                        type: string;
                    } & {
                        [key: string]: unknown;
                    };
                };
            };
        };
    };
    auth_request: {
        parameters: {
            query?: never;
            header: {
                /** @description The API key the request came with */
                "x-allot-api-key-id"?: string;
                /** @description Cost in whole units (1) */
                "x-allot-cost"?: number;
                /** @description Charge the cost as an estimate (false) */
                "x-allot-metered"?: boolean;
                /** @description The request's method (GET) */
                "x-allot-method"?: string;
                /** @description The verified principal */
                "x-allot-principal-id": string;
                /** @description user, api_key or ip */
                "x-allot-principal-type": components["schemas"]["PrincipalType"];
                /** @description Unique per request, stable across retries */
                "x-allot-request-id": components["schemas"]["DecisionId"];
                /** @description The request's route group */
                "x-allot-route-group": components["schemas"]["RouteGroup"];
                /** @description The verified tenant */
                "x-allot-tenant": components["schemas"]["TenantId"];
            };
            path?: never;
            cookie?: never;
        };
        requestBody?: never;
        responses: {
            /** @description Admitted */
            204: {
                headers: {
                    ratelimit?: string;
                    "ratelimit-policy"?: string;
                    [name: string]: unknown;
                };
                content?: never;
            };
            /** @description Bad input: problem+json naming the field (in the body, the query or a header) at fault. */
            400: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": {
                        /** @description The decision this problem belongs to, when there is one. */
                        decisionId?: string | null;
                        /** @description What happened, for a human. */
                        detail: string;
                        /** @description The request field at fault, when there is one (e.g. `rules[2].capacityMillis`). */
                        field?: string | null;
                        /**
                         * Format: u-int16
                         * @description The HTTP status.
                         */
                        status: number;
                        /** @description A short summary of the problem type. */
                        title: string;
                        /** @description A URI naming the problem type; `about:blank` when the status says it all. */
                        type: string;
                    } & {
                        [key: string]: unknown;
                    };
                };
            };
            /** @description No gateway token, or an unknown one. */
            401: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": {
                        /** @description The decision this problem belongs to, when there is one. */
                        decisionId?: string | null;
                        /** @description What happened, for a human. */
                        detail: string;
                        /** @description The request field at fault, when there is one (e.g. `rules[2].capacityMillis`). */
                        field?: string | null;
                        /**
                         * Format: u-int16
                         * @description The HTTP status.
                         */
                        status: number;
                        /** @description A short summary of the problem type. */
                        title: string;
                        /** @description A URI naming the problem type; `about:blank` when the status says it all. */
                        type: string;
                    } & {
                        [key: string]: unknown;
                    };
                };
            };
            /** @description Refused: `X-Allot-Status` says how to answer the caller (429 or 503) */
            403: {
                headers: {
                    "retry-after"?: number;
                    "x-allot-status"?: number;
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": components["schemas"]["Problem"];
                };
            };
        };
    };
    check: {
        parameters: {
            query?: never;
            header?: never;
            path?: never;
            cookie?: never;
        };
        requestBody: {
            content: {
                "application/json": components["schemas"]["AdmissionRequest"];
            };
        };
        responses: {
            /** @description Admitted; `RateLimit-Policy` and `RateLimit` when the caller may see its limit */
            200: {
                headers: {
                    ratelimit?: string;
                    "ratelimit-policy"?: string;
                    "x-allot-settle-by-ms"?: number;
                    [name: string]: unknown;
                };
                content?: never;
            };
            /** @description Bad input: problem+json naming the field (in the body, the query or a header) at fault. */
            400: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": {
                        /** @description The decision this problem belongs to, when there is one. */
                        decisionId?: string | null;
                        /** @description What happened, for a human. */
                        detail: string;
                        /** @description The request field at fault, when there is one (e.g. `rules[2].capacityMillis`). */
                        field?: string | null;
                        /**
                         * Format: u-int16
                         * @description The HTTP status.
                         */
                        status: number;
                        /** @description A short summary of the problem type. */
                        title: string;
                        /** @description A URI naming the problem type; `about:blank` when the status says it all. */
                        type: string;
                    } & {
                        [key: string]: unknown;
                    };
                };
            };
            /** @description No gateway token, or an unknown one. */
            401: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": {
                        /** @description The decision this problem belongs to, when there is one. */
                        decisionId?: string | null;
                        /** @description What happened, for a human. */
                        detail: string;
                        /** @description The request field at fault, when there is one (e.g. `rules[2].capacityMillis`). */
                        field?: string | null;
                        /**
                         * Format: u-int16
                         * @description The HTTP status.
                         */
                        status: number;
                        /** @description A short summary of the problem type. */
                        title: string;
                        /** @description A URI naming the problem type; `about:blank` when the status says it all. */
                        type: string;
                    } & {
                        [key: string]: unknown;
                    };
                };
            };
            /** @description The body is larger than 16 KiB. */
            413: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": {
                        /** @description The decision this problem belongs to, when there is one. */
                        decisionId?: string | null;
                        /** @description What happened, for a human. */
                        detail: string;
                        /** @description The request field at fault, when there is one (e.g. `rules[2].capacityMillis`). */
                        field?: string | null;
                        /**
                         * Format: u-int16
                         * @description The HTTP status.
                         */
                        status: number;
                        /** @description A short summary of the problem type. */
                        title: string;
                        /** @description A URI naming the problem type; `about:blank` when the status says it all. */
                        type: string;
                    } & {
                        [key: string]: unknown;
                    };
                };
            };
            /** @description The body is not `application/json`. */
            415: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": {
                        /** @description The decision this problem belongs to, when there is one. */
                        decisionId?: string | null;
                        /** @description What happened, for a human. */
                        detail: string;
                        /** @description The request field at fault, when there is one (e.g. `rules[2].capacityMillis`). */
                        field?: string | null;
                        /**
                         * Format: u-int16
                         * @description The HTTP status.
                         */
                        status: number;
                        /** @description A short summary of the problem type. */
                        title: string;
                        /** @description A URI naming the problem type; `about:blank` when the status says it all. */
                        type: string;
                    } & {
                        [key: string]: unknown;
                    };
                };
            };
            /** @description A limit said no; `Retry-After` in whole seconds unless it never will */
            429: {
                headers: {
                    "retry-after"?: number;
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": components["schemas"]["Problem"];
                };
            };
            /** @description A fail-closed rule could not be decided */
            503: {
                headers: {
                    "retry-after"?: number;
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": components["schemas"]["Problem"];
                };
            };
        };
    };
    quota: {
        parameters: {
            query: {
                /** @description The verified principal (hashed, never stored). */
                principalId: string;
                /** @description The verified principal's kind. */
                principalType: components["schemas"]["PrincipalType"];
                /** @description Only the rules of this route group (and those of every route group); absent: all. */
                routeGroup?: components["schemas"]["RouteGroup"];
                /** @description The verified tenant. */
                tenantId: components["schemas"]["TenantId"];
            };
            header?: never;
            path?: never;
            cookie?: never;
        };
        requestBody?: never;
        responses: {
            /** @description The caller's quotas */
            200: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/json": components["schemas"]["QuotaStatus"];
                };
            };
            /** @description Bad input: problem+json naming the field (in the body, the query or a header) at fault. */
            400: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": {
                        /** @description The decision this problem belongs to, when there is one. */
                        decisionId?: string | null;
                        /** @description What happened, for a human. */
                        detail: string;
                        /** @description The request field at fault, when there is one (e.g. `rules[2].capacityMillis`). */
                        field?: string | null;
                        /**
                         * Format: u-int16
                         * @description The HTTP status.
                         */
                        status: number;
                        /** @description A short summary of the problem type. */
                        title: string;
                        /** @description A URI naming the problem type; `about:blank` when the status says it all. */
                        type: string;
                    } & {
                        [key: string]: unknown;
                    };
                };
            };
            /** @description No gateway token, or an unknown one. */
            401: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": {
                        /** @description The decision this problem belongs to, when there is one. */
                        decisionId?: string | null;
                        /** @description What happened, for a human. */
                        detail: string;
                        /** @description The request field at fault, when there is one (e.g. `rules[2].capacityMillis`). */
                        field?: string | null;
                        /**
                         * Format: u-int16
                         * @description The HTTP status.
                         */
                        status: number;
                        /** @description A short summary of the problem type. */
                        title: string;
                        /** @description A URI naming the problem type; `about:blank` when the status says it all. */
                        type: string;
                    } & {
                        [key: string]: unknown;
                    };
                };
            };
            /** @description No policy bundle yet */
            503: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": components["schemas"]["Problem"];
                };
            };
        };
    };
    release: {
        parameters: {
            query?: never;
            header?: never;
            path?: never;
            cookie?: never;
        };
        requestBody: {
            content: {
                "application/json": components["schemas"]["AdmissionRequest"];
            };
        };
        responses: {
            /** @description Released (or nothing was held) */
            204: {
                headers: {
                    [name: string]: unknown;
                };
                content?: never;
            };
            /** @description Bad input: problem+json naming the field (in the body, the query or a header) at fault. */
            400: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": {
                        /** @description The decision this problem belongs to, when there is one. */
                        decisionId?: string | null;
                        /** @description What happened, for a human. */
                        detail: string;
                        /** @description The request field at fault, when there is one (e.g. `rules[2].capacityMillis`). */
                        field?: string | null;
                        /**
                         * Format: u-int16
                         * @description The HTTP status.
                         */
                        status: number;
                        /** @description A short summary of the problem type. */
                        title: string;
                        /** @description A URI naming the problem type; `about:blank` when the status says it all. */
                        type: string;
                    } & {
                        [key: string]: unknown;
                    };
                };
            };
            /** @description No gateway token, or an unknown one. */
            401: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": {
                        /** @description The decision this problem belongs to, when there is one. */
                        decisionId?: string | null;
                        /** @description What happened, for a human. */
                        detail: string;
                        /** @description The request field at fault, when there is one (e.g. `rules[2].capacityMillis`). */
                        field?: string | null;
                        /**
                         * Format: u-int16
                         * @description The HTTP status.
                         */
                        status: number;
                        /** @description A short summary of the problem type. */
                        title: string;
                        /** @description A URI naming the problem type; `about:blank` when the status says it all. */
                        type: string;
                    } & {
                        [key: string]: unknown;
                    };
                };
            };
            /** @description The body is larger than 16 KiB. */
            413: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": {
                        /** @description The decision this problem belongs to, when there is one. */
                        decisionId?: string | null;
                        /** @description What happened, for a human. */
                        detail: string;
                        /** @description The request field at fault, when there is one (e.g. `rules[2].capacityMillis`). */
                        field?: string | null;
                        /**
                         * Format: u-int16
                         * @description The HTTP status.
                         */
                        status: number;
                        /** @description A short summary of the problem type. */
                        title: string;
                        /** @description A URI naming the problem type; `about:blank` when the status says it all. */
                        type: string;
                    } & {
                        [key: string]: unknown;
                    };
                };
            };
            /** @description The body is not `application/json`. */
            415: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": {
                        /** @description The decision this problem belongs to, when there is one. */
                        decisionId?: string | null;
                        /** @description What happened, for a human. */
                        detail: string;
                        /** @description The request field at fault, when there is one (e.g. `rules[2].capacityMillis`). */
                        field?: string | null;
                        /**
                         * Format: u-int16
                         * @description The HTTP status.
                         */
                        status: number;
                        /** @description A short summary of the problem type. */
                        title: string;
                        /** @description A URI naming the problem type; `about:blank` when the status says it all. */
                        type: string;
                    } & {
                        [key: string]: unknown;
                    };
                };
            };
        };
    };
    renew: {
        parameters: {
            query?: never;
            header?: never;
            path?: never;
            cookie?: never;
        };
        requestBody: {
            content: {
                "application/json": components["schemas"]["AdmissionRequest"];
            };
        };
        responses: {
            /** @description What the heartbeat did */
            200: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/json": components["schemas"]["SlotRenewal"];
                };
            };
            /** @description Bad input: problem+json naming the field (in the body, the query or a header) at fault. */
            400: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": {
                        /** @description The decision this problem belongs to, when there is one. */
                        decisionId?: string | null;
                        /** @description What happened, for a human. */
                        detail: string;
                        /** @description The request field at fault, when there is one (e.g. `rules[2].capacityMillis`). */
                        field?: string | null;
                        /**
                         * Format: u-int16
                         * @description The HTTP status.
                         */
                        status: number;
                        /** @description A short summary of the problem type. */
                        title: string;
                        /** @description A URI naming the problem type; `about:blank` when the status says it all. */
                        type: string;
                    } & {
                        [key: string]: unknown;
                    };
                };
            };
            /** @description No gateway token, or an unknown one. */
            401: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": {
                        /** @description The decision this problem belongs to, when there is one. */
                        decisionId?: string | null;
                        /** @description What happened, for a human. */
                        detail: string;
                        /** @description The request field at fault, when there is one (e.g. `rules[2].capacityMillis`). */
                        field?: string | null;
                        /**
                         * Format: u-int16
                         * @description The HTTP status.
                         */
                        status: number;
                        /** @description A short summary of the problem type. */
                        title: string;
                        /** @description A URI naming the problem type; `about:blank` when the status says it all. */
                        type: string;
                    } & {
                        [key: string]: unknown;
                    };
                };
            };
            /** @description The body is larger than 16 KiB. */
            413: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": {
                        /** @description The decision this problem belongs to, when there is one. */
                        decisionId?: string | null;
                        /** @description What happened, for a human. */
                        detail: string;
                        /** @description The request field at fault, when there is one (e.g. `rules[2].capacityMillis`). */
                        field?: string | null;
                        /**
                         * Format: u-int16
                         * @description The HTTP status.
                         */
                        status: number;
                        /** @description A short summary of the problem type. */
                        title: string;
                        /** @description A URI naming the problem type; `about:blank` when the status says it all. */
                        type: string;
                    } & {
                        [key: string]: unknown;
                    };
                };
            };
            /** @description The body is not `application/json`. */
            415: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": {
                        /** @description The decision this problem belongs to, when there is one. */
                        decisionId?: string | null;
                        /** @description What happened, for a human. */
                        detail: string;
                        /** @description The request field at fault, when there is one (e.g. `rules[2].capacityMillis`). */
                        field?: string | null;
                        /**
                         * Format: u-int16
                         * @description The HTTP status.
                         */
                        status: number;
                        /** @description A short summary of the problem type. */
                        title: string;
                        /** @description A URI naming the problem type; `about:blank` when the status says it all. */
                        type: string;
                    } & {
                        [key: string]: unknown;
                    };
                };
            };
        };
    };
    settle: {
        parameters: {
            query?: never;
            header?: never;
            path?: never;
            cookie?: never;
        };
        requestBody: {
            content: {
                "application/json": components["schemas"]["SettleRequest"];
            };
        };
        responses: {
            /** @description How the difference was charged */
            200: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/json": components["schemas"]["SettleAnswer"];
                };
            };
            /** @description Bad input: problem+json naming the field (in the body, the query or a header) at fault. */
            400: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": {
                        /** @description The decision this problem belongs to, when there is one. */
                        decisionId?: string | null;
                        /** @description What happened, for a human. */
                        detail: string;
                        /** @description The request field at fault, when there is one (e.g. `rules[2].capacityMillis`). */
                        field?: string | null;
                        /**
                         * Format: u-int16
                         * @description The HTTP status.
                         */
                        status: number;
                        /** @description A short summary of the problem type. */
                        title: string;
                        /** @description A URI naming the problem type; `about:blank` when the status says it all. */
                        type: string;
                    } & {
                        [key: string]: unknown;
                    };
                };
            };
            /** @description No gateway token, or an unknown one. */
            401: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": {
                        /** @description The decision this problem belongs to, when there is one. */
                        decisionId?: string | null;
                        /** @description What happened, for a human. */
                        detail: string;
                        /** @description The request field at fault, when there is one (e.g. `rules[2].capacityMillis`). */
                        field?: string | null;
                        /**
                         * Format: u-int16
                         * @description The HTTP status.
                         */
                        status: number;
                        /** @description A short summary of the problem type. */
                        title: string;
                        /** @description A URI naming the problem type; `about:blank` when the status says it all. */
                        type: string;
                    } & {
                        [key: string]: unknown;
                    };
                };
            };
            /** @description Nothing of that id is open for settlement */
            404: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": components["schemas"]["Problem"];
                };
            };
            /** @description Settled before with another cost */
            409: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": components["schemas"]["Problem"];
                };
            };
            /** @description The body is larger than 16 KiB. */
            413: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": {
                        /** @description The decision this problem belongs to, when there is one. */
                        decisionId?: string | null;
                        /** @description What happened, for a human. */
                        detail: string;
                        /** @description The request field at fault, when there is one (e.g. `rules[2].capacityMillis`). */
                        field?: string | null;
                        /**
                         * Format: u-int16
                         * @description The HTTP status.
                         */
                        status: number;
                        /** @description A short summary of the problem type. */
                        title: string;
                        /** @description A URI naming the problem type; `about:blank` when the status says it all. */
                        type: string;
                    } & {
                        [key: string]: unknown;
                    };
                };
            };
            /** @description The body is not `application/json`. */
            415: {
                headers: {
                    [name: string]: unknown;
                };
                content: {
                    "application/problem+json": {
                        /** @description The decision this problem belongs to, when there is one. */
                        decisionId?: string | null;
                        /** @description What happened, for a human. */
                        detail: string;
                        /** @description The request field at fault, when there is one (e.g. `rules[2].capacityMillis`). */
                        field?: string | null;
                        /**
                         * Format: u-int16
                         * @description The HTTP status.
                         */
                        status: number;
                        /** @description A short summary of the problem type. */
                        title: string;
                        /** @description A URI naming the problem type; `about:blank` when the status says it all. */
                        type: string;
                    } & {
                        [key: string]: unknown;
                    };
                };
            };
        };
    };
}

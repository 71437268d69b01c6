// The typed client: one method per agent endpoint, every call bounded in time, size and attempts.
//
// A call that gets no answer (the connection fails, the attempt times out, something between
// answers 500, 502 or 504, which the agent never sends) is tried again with the same body, so an
// admission keeps its requestId and a rule that says `idempotent` answers the retry with the first
// admission instead of charging twice. An answer, even a refusal, is never retried.
import * as http from "node:http";
import * as https from "node:https";

import {
  type AdmissionRequest,
  type Decision,
  type Problem,
  type QuotaQuery,
  type QuotaStatus,
  type SettleAnswer,
  type SettleRequest,
  type SlotRenewal,
  FieldError,
  validateAdmission,
  validateQuotaQuery,
  validateSettlement,
} from "./wire.js";

/** How long one attempt may take unless set otherwise, ms (the agent answers within its own 2 s). */
export const DEFAULT_CALL_TIMEOUT_MS = 500;
/** Attempts of one call unless set otherwise (the first and one retry). */
export const DEFAULT_MAX_ATTEMPTS = 2;
/** Most attempts a client may be set to make: every retry is bounded. */
export const MAX_ATTEMPTS = 5;
/** Longest a client may let one attempt take, ms. */
export const MAX_CALL_TIMEOUT_MS = 10_000;
/** Pause before the first retry unless set otherwise, ms; each later one doubles, plus jitter. */
export const DEFAULT_RETRY_BACKOFF_MS = 20;
/** Largest answer read, bytes: an agent's answers are a few kilobytes. */
export const MAX_ANSWER_BYTES = 1 << 20;

/** The headers of a `/v1/check` answer a caller may be shown. */
export const CALLER_HEADERS = [
  "retry-after",
  "ratelimit-policy",
  "ratelimit",
  "x-allot-soft-limit-exceeded",
] as const;

/** The media type of the agent's refusals, and of the middleware's. */
export const PROBLEM_CONTENT_TYPE = "application/problem+json";

/** Why a call has no answer to give. */
export class ClientError extends Error {
  private constructor(
    /** `invalid`: not sent, it breaks the contract; `unreachable`: no answer after every attempt;
     * `refused`: the agent answered and refused the call; `config`: the client cannot be built. */
    readonly kind: "invalid" | "unreachable" | "refused" | "config",
    message: string,
    /** The field at fault, for `invalid`. */
    readonly field?: string,
    /** The HTTP status, for `refused`. */
    readonly status?: number,
    /** The agent's problem+json, for `refused`. */
    readonly problem?: Problem,
    /** Attempts made, for `unreachable`. */
    readonly attempts?: number,
  ) {
    super(message);
    this.name = "ClientError";
  }

  static invalid(error: FieldError): ClientError {
    return new ClientError("invalid", `invalid request: ${error.message}`, error.field);
  }

  static unreachable(url: string, attempts: number, last: string): ClientError {
    return new ClientError(
      "unreachable",
      `the agent at ${url} did not answer after ${attempts} attempt(s): ${last}`,
      undefined,
      undefined,
      undefined,
      attempts,
    );
  }

  static refused(status: number, problem: Problem): ClientError {
    return new ClientError(
      "refused",
      `the agent refused the call (${status}): ${problem.detail}`,
      problem.field ?? undefined,
      status,
      problem,
    );
  }

  static config(why: string): ClientError {
    return new ClientError("config", `client configuration: ${why}`);
  }
}

/** The answer of `POST /v1/check`: the decision as a proxy passes it on. */
export interface Checked {
  /** 200 when admitted, 429 when a limit said no, 503 when a fail-closed rule could not decide. */
  status: number;
  allowed: boolean;
  /** The headers the caller may be shown, lower-case names, only those the agent sent. */
  callerHeaders: Record<string, string>;
  /** The shadow rules that would have refused, for the service's logs; never for the caller. */
  shadowDenied?: string;
  /** A metered admission's settle deadline, epoch ms. */
  settleByMs?: number;
  /** A refusal's problem+json, as the caller may read it. */
  problem?: Problem;
}

/** The whole seconds a refused caller should wait, when the agent said. */
export function retryAfterSeconds(checked: Checked): number | undefined {
  const value = checked.callerHeaders["retry-after"];
  return value !== undefined && /^\d+$/.test(value) ? Number(value) : undefined;
}

export interface ClientOptions {
  /** The agent's base URL, `https://agent.eu.internal:7701`. */
  baseUrl: string;
  /** A gateway token the agent accepts (`--gateway-token-file`). */
  gatewayToken: string;
  /** CA certificates (PEM) to trust instead of the system's, for an `https://` agent. */
  ca?: string | Buffer;
  /** A client certificate and key (PEM) for an agent that asks for one. */
  cert?: string | Buffer;
  key?: string | Buffer;
  /** How long one attempt may take, ms (default 500, at most 10,000). */
  callTimeoutMs?: number;
  /** Attempts of one call in all (default 2, 1 to 5). */
  maxAttempts?: number;
  /** Pause before the first retry, ms (default 20). */
  retryBackoffMs?: number;
}

interface Answer {
  status: number;
  headers: http.IncomingHttpHeaders;
  body: Buffer;
}

/** A client of one region agent's gateway API. One keep-alive connection pool; share it. */
export class AgentClient {
  readonly baseUrl: string;
  readonly maxAttempts: number;
  readonly callTimeoutMs: number;
  private readonly retryBackoffMs: number;
  /** `Bearer <token>`: private, so that neither logging nor inspecting the client shows it. */
  readonly #authorization: string;
  private readonly transport: typeof http | typeof https;
  private readonly agent: http.Agent;
  /** Retries made, for the service's metrics. */
  retries = 0;

  constructor(options: ClientOptions) {
    const baseUrl = options.baseUrl.replace(/\/+$/, "");
    if (!/^https?:\/\//.test(baseUrl)) {
      throw ClientError.config(`the agent URL must start with http:// or https://, not ${JSON.stringify(baseUrl)}`);
    }
    const token = options.gatewayToken.trim();
    if (token === "") throw ClientError.config("the gateway token is empty");
    // Never echoed: a token is a secret, and a header that cannot carry it would print it.
    if (!/^[\x21-\x7e]+$/.test(token)) {
      throw ClientError.config("the gateway token must be visible ASCII characters, without spaces");
    }
    const maxAttempts = options.maxAttempts ?? DEFAULT_MAX_ATTEMPTS;
    if (!Number.isInteger(maxAttempts) || maxAttempts < 1 || maxAttempts > MAX_ATTEMPTS) {
      throw ClientError.config(`max attempts must be 1 to ${MAX_ATTEMPTS}, not ${maxAttempts}`);
    }
    const callTimeoutMs = options.callTimeoutMs ?? DEFAULT_CALL_TIMEOUT_MS;
    if (!(callTimeoutMs > 0 && callTimeoutMs <= MAX_CALL_TIMEOUT_MS)) {
      throw ClientError.config(`the call timeout must be above 0 and at most ${MAX_CALL_TIMEOUT_MS} ms`);
    }
    const retryBackoffMs = options.retryBackoffMs ?? DEFAULT_RETRY_BACKOFF_MS;
    if (!(retryBackoffMs >= 0 && retryBackoffMs <= MAX_CALL_TIMEOUT_MS)) {
      throw ClientError.config(`the retry backoff must be 0 to ${MAX_CALL_TIMEOUT_MS} ms`);
    }
    const secure = baseUrl.startsWith("https://");
    this.baseUrl = baseUrl;
    this.maxAttempts = maxAttempts;
    this.callTimeoutMs = callTimeoutMs;
    this.retryBackoffMs = retryBackoffMs;
    this.#authorization = `Bearer ${token}`;
    this.transport = secure ? https : http;
    this.agent = secure
      ? new https.Agent({ keepAlive: true, maxSockets: 64, ca: options.ca, cert: options.cert, key: options.key })
      : new http.Agent({ keepAlive: true, maxSockets: 64 });
  }

  /** What `JSON.stringify` shows of a client: where it calls and how often (the token is private
   * anyway; the connection pool is no data). */
  toJSON(): object {
    return { baseUrl: this.baseUrl, maxAttempts: this.maxAttempts };
  }

  /** Closes the idle connections (the process can then exit). */
  close(): void {
    this.agent.destroy();
  }

  /** `POST /v1/admit`: the decision. */
  async admit(request: AdmissionRequest): Promise<Decision> {
    guard(() => validateAdmission(request));
    const answer = await this.send("POST", "/v1/admit", request);
    if (answer.status === 200) return this.json<Decision>(answer);
    throw refused(answer);
  }

  /** `POST /v1/check`: the decision as a proxy passes it on. */
  async check(request: AdmissionRequest): Promise<Checked> {
    guard(() => validateAdmission(request));
    const answer = await this.send("POST", "/v1/check", request);
    const decided =
      answer.status === 200 || ((answer.status === 429 || answer.status === 503) && isProblem(answer));
    if (!decided) throw refused(answer);
    const callerHeaders: Record<string, string> = {};
    for (const name of CALLER_HEADERS) {
      const value = header(answer, name);
      if (value !== undefined) callerHeaders[name] = value;
    }
    const allowed = answer.status === 200;
    const checked: Checked = { status: answer.status, allowed, callerHeaders };
    const shadowDenied = header(answer, "x-allot-shadow-denied");
    if (shadowDenied !== undefined) checked.shadowDenied = shadowDenied;
    const settleBy = header(answer, "x-allot-settle-by-ms");
    if (settleBy !== undefined && /^\d+$/.test(settleBy)) checked.settleByMs = Number(settleBy);
    if (!allowed) checked.problem = problemOf(answer);
    return checked;
  }

  /** `POST /v1/release`: gives back the concurrency slots `request` holds (idempotent). */
  async release(request: AdmissionRequest): Promise<void> {
    guard(() => validateAdmission(request));
    const answer = await this.send("POST", "/v1/release", request);
    if (answer.status !== 204 && answer.status !== 200) throw refused(answer);
  }

  /** `POST /v1/renew`: extends the concurrency slots `request` holds (a heartbeat). */
  async renew(request: AdmissionRequest): Promise<SlotRenewal> {
    guard(() => validateAdmission(request));
    const answer = await this.send("POST", "/v1/renew", request);
    if (answer.status === 200) return this.json<SlotRenewal>(answer);
    throw refused(answer);
  }

  /** `POST /v1/settle`: the actual cost of a metered admission (404: nothing of that id is open;
   * 409: settled before with another cost). */
  async settle(settlement: SettleRequest): Promise<SettleAnswer> {
    guard(() => validateSettlement(settlement));
    const answer = await this.send("POST", "/v1/settle", settlement);
    if (answer.status === 200) return this.json<SettleAnswer>(answer);
    throw refused(answer);
  }

  /** `GET /v1/quota`: the caller's own quotas and what is left of them. */
  async quota(query: QuotaQuery): Promise<QuotaStatus> {
    guard(() => validateQuotaQuery(query));
    const params = new URLSearchParams({
      tenantId: query.tenantId,
      principalType: query.principalType,
      principalId: query.principalId,
    });
    if (query.routeGroup !== undefined) params.set("routeGroup", query.routeGroup);
    const answer = await this.send("GET", `/v1/quota?${params}`);
    if (answer.status === 200) return this.json<QuotaStatus>(answer);
    throw refused(answer);
  }

  /** `GET /healthz`: whether the agent's process answers. */
  async healthz(): Promise<boolean> {
    return (await this.send("GET", "/healthz")).status === 200;
  }

  /** `GET /readyz`: ready (a policy bundle) or not, with what the agent said. */
  async readyz(): Promise<{ ready: boolean; detail: string }> {
    const answer = await this.send("GET", "/readyz");
    const ready = answer.status === 200;
    return { ready, detail: ready ? answer.body.toString("utf8").trim() : problemOf(answer).detail };
  }

  /** `GET /metrics`: the agent's Prometheus text. */
  async metrics(): Promise<string> {
    const answer = await this.send("GET", "/metrics");
    if (answer.status === 200) return answer.body.toString("utf8");
    throw refused(answer);
  }

  /** `GET /openapi.json`: the agent's OpenAPI document. */
  async openapi(): Promise<Record<string, unknown>> {
    const answer = await this.send("GET", "/openapi.json");
    if (answer.status === 200) return this.json<Record<string, unknown>>(answer);
    throw refused(answer);
  }

  private json<T>(answer: Answer): T {
    try {
      return JSON.parse(answer.body.toString("utf8")) as T;
    } catch (error) {
      throw ClientError.unreachable(this.baseUrl, 1, `an answer that is not the contract's: ${String(error)}`);
    }
  }

  /** Sends until an attempt gets an answer, at most `maxAttempts` times, with the same body. */
  private async send(method: string, path: string, body?: unknown): Promise<Answer> {
    const bytes = body === undefined ? undefined : Buffer.from(JSON.stringify(body));
    let last = "";
    for (let attempt = 1; attempt <= this.maxAttempts; attempt++) {
      if (attempt > 1) {
        await sleep(backoffMs(this.retryBackoffMs, attempt));
        this.retries++;
      }
      try {
        const answer = await this.attempt(method, path, bytes);
        if (!isNoAnswer(answer.status)) return answer;
        last = `${answer.status} from something between`;
      } catch (error) {
        last = error instanceof Error ? error.message : String(error);
      }
    }
    throw ClientError.unreachable(this.baseUrl, this.maxAttempts, last);
  }

  private attempt(method: string, path: string, body: Buffer | undefined): Promise<Answer> {
    return new Promise<Answer>((resolve, reject) => {
      const headers: http.OutgoingHttpHeaders = { authorization: this.#authorization, accept: "application/json" };
      if (body !== undefined) {
        headers["content-type"] = "application/json";
        headers["content-length"] = body.length;
      }
      const request = this.transport.request(
        `${this.baseUrl}${path}`,
        { method, headers, agent: this.agent },
        (response) => {
          const chunks: Buffer[] = [];
          let size = 0;
          let ended = false;
          response.on("data", (chunk: Buffer) => {
            size += chunk.length;
            if (size > MAX_ANSWER_BYTES) {
              request.destroy(new Error(`an answer larger than ${MAX_ANSWER_BYTES} bytes`));
              return;
            }
            chunks.push(chunk);
          });
          response.on("end", () => {
            ended = true;
            clearTimeout(timer);
            resolve({ status: response.statusCode ?? 0, headers: response.headers, body: Buffer.concat(chunks) });
          });
          response.on("error", reject);
          response.on("close", () => {
            if (!ended) reject(new Error("the answer was cut short"));
          });
        },
      );
      const timer = setTimeout(
        () => request.destroy(new Error(`no answer within ${this.callTimeoutMs} ms`)),
        this.callTimeoutMs,
      );
      request.on("error", (error) => {
        clearTimeout(timer);
        reject(error);
      });
      request.end(body);
    });
  }
}

function guard(validate: () => void): void {
  try {
    validate();
  } catch (error) {
    if (error instanceof FieldError) throw ClientError.invalid(error);
    throw error;
  }
}

function header(answer: Answer, name: string): string | undefined {
  const value = answer.headers[name];
  return Array.isArray(value) ? value.join(", ") : value;
}

function isProblem(answer: Answer): boolean {
  return (header(answer, "content-type") ?? "").startsWith(PROBLEM_CONTENT_TYPE);
}

function problemOf(answer: Answer): Problem {
  try {
    const problem = JSON.parse(answer.body.toString("utf8")) as Problem;
    if (typeof problem === "object" && problem !== null && typeof problem.detail === "string") return problem;
  } catch {
    // Not JSON: worded from the status below.
  }
  return {
    type: "about:blank",
    title: http.STATUS_CODES[answer.status] ?? "Error",
    status: answer.status,
    detail: answer.body.toString("utf8").trim().slice(0, 512),
  };
}

function refused(answer: Answer): ClientError {
  return ClientError.refused(answer.status, problemOf(answer));
}

/** Statuses the agent never sends: a proxy's, a load balancer's or a crash's. */
export function isNoAnswer(status: number): boolean {
  return status === 500 || status === 502 || status === 504;
}

/** The pause before attempt `attempt` (2 or more): `base * 2^(attempt-2)` plus up to as much again. */
export function backoffMs(baseMs: number, attempt: number): number {
  const pause = baseMs * 2 ** Math.min(Math.max(attempt - 2, 0), 16);
  return pause + Math.floor(Math.random() * (pause + 1));
}

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

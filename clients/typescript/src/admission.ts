// What the Express and Fastify middleware share: how a request is admitted, refused or let through
// without a decision, and what it owes the agent when its response ends (its concurrency slots
// back, its metered cost settled). The frameworks differ only in how they write a response.
import { randomUUID } from "node:crypto";
import type { IncomingMessage, ServerResponse } from "node:http";

import { type AgentClient, type Checked, ClientError, PROBLEM_CONTENT_TYPE } from "./client.js";
import type { AdmissionRequest, Principal, Problem } from "./wire.js";

/** What to do with a request the agent gave no decision for (unreachable, timed out, or refusing
 * the call itself: a wrong gateway token, a request it cannot read). `closed` (the default) refuses
 * it with 503 and `Retry-After: 1`; `open` lets it through unlimited. */
export type FailMode = "closed" | "open";

/** How one request is to be admitted: from the verified identity only. */
export interface Admission {
  tenantId: string;
  principal: Principal;
  routeGroup: string;
  /** Units the request costs (1 to 2^30; default 1). For a metered request, the estimate. */
  cost?: number;
  /** Charge `cost` now and the actual cost when the response ends, as the service states it on
   * the request's meter (unstated, the estimate stands). */
  metered?: boolean;
  /** The route's rules hold concurrency slots: give them back when the response ends. */
  releasesSlots?: boolean;
  /** Renew the request's slots every this many ms while the response runs (a third of the rule's
   * `concurrencyLeaseTtlMs` is a good period); implies `releasesSlots`. */
  renewEveryMs?: number;
  /** The request's id, when the service has one stable across the caller's retries (1 to 64 of
   * `A-Z a-z 0-9 - _ .`, from a source the caller cannot choose). Otherwise a fresh UUID. */
  requestId?: string;
  /** This request's fail mode, instead of the middleware's. */
  whenUndecided?: FailMode;
}

/** Says how to admit a request, or nothing to let it through unlimited. */
export type Identify<Request> = (request: Request) => Admission | null | undefined | Promise<Admission | null | undefined>;

export interface MiddlewareOptions<Request> {
  client: AgentClient;
  identify: Identify<Request>;
  /** Without a decision (default `closed`). */
  whenUndecided?: FailMode;
  /** Told about every request let through or refused without a decision, and every completion
   * call that failed (default: a warning on the console). */
  onWarning?: (message: string, error: unknown) => void;
}

/** A metered request's actual cost, for the service to state; settled when the response ends. */
export class MeteredCost {
  private units: number | undefined;

  /** States the actual cost, whole units (the last statement counts). */
  set(units: number): void {
    this.units = wholeUnits(units);
  }

  /** Adds to the actual cost (for a response that counts as it streams). */
  add(units: number): void {
    this.units = wholeUnits((this.units ?? 0) + units);
  }

  /** The stated cost, if any. */
  get(): number | undefined {
    return this.units;
  }
}

function wholeUnits(units: number): number {
  if (!Number.isFinite(units) || units < 0) throw new RangeError(`a cost must be a whole number of units, not ${units}`);
  return Math.min(Math.ceil(units), Number.MAX_SAFE_INTEGER);
}

/** What an admitted request carries for the service: the agent's answer and, when metered, the meter. */
export interface Admitted {
  checked: Checked;
  requestId: string;
  meter?: MeteredCost;
}

/** What the middleware does with one request. */
export type Outcome =
  | { kind: "pass" }
  | { kind: "admitted"; admitted: Admitted; headers: Record<string, string>; complete: Completion | undefined }
  | { kind: "refused"; status: number; headers: Record<string, string>; problem: Problem };

const UNAVAILABLE: Problem = {
  type: "about:blank",
  title: "Rate limiter unavailable",
  status: 503,
  detail: "The request could not be checked against its quota. Retry later.",
};

export { PROBLEM_CONTENT_TYPE };

/** Where an admitted request carries what the middleware learned of it. */
const ADMITTED = Symbol.for("allot.admitted");

/** What the middleware learned of an admitted request (its meter when metered), or undefined. */
export function allotOf(request: IncomingMessage): Admitted | undefined {
  return (request as IncomingMessage & { [ADMITTED]?: Admitted })[ADMITTED];
}

/** Marks `request` admitted, for {@link allotOf}. */
export function markAdmitted(request: IncomingMessage, admitted: Admitted): void {
  (request as IncomingMessage & { [ADMITTED]?: Admitted })[ADMITTED] = admitted;
}

/** Asks the agent about one request and says what to do with it. */
export async function decide<Request>(
  options: MiddlewareOptions<Request>,
  request: Request,
  method: string,
): Promise<Outcome> {
  const warn = options.onWarning ?? defaultWarning;
  let admission: Admission | null | undefined;
  try {
    admission = await options.identify(request);
  } catch (error) {
    warn("identify threw: the request is refused", error);
    return undecided("closed", warn, error);
  }
  if (!admission) return { kind: "pass" };
  const mode = admission.whenUndecided ?? options.whenUndecided ?? "closed";
  const wire = toWire(admission, method);
  let checked: Checked;
  try {
    checked = await options.client.check(wire);
  } catch (error) {
    return undecided(mode, warn, error);
  }
  if (!checked.allowed) {
    return {
      kind: "refused",
      status: checked.status,
      headers: checked.callerHeaders,
      // A refusal always carries the agent's problem (`AgentClient.check`).
      problem: checked.problem as Problem,
    };
  }
  const meter = admission.metered ? new MeteredCost() : undefined;
  const admitted: Admitted = { checked, requestId: wire.requestId, ...(meter ? { meter } : {}) };
  const headers = Object.fromEntries(Object.entries(checked.callerHeaders).filter(([name]) => name !== "retry-after"));
  const releasesSlots = admission.releasesSlots === true || admission.renewEveryMs !== undefined;
  const complete =
    releasesSlots || meter
      ? new Completion(options.client, wire, releasesSlots, meter, admission.renewEveryMs, warn)
      : undefined;
  return { kind: "admitted", admitted, headers, complete };
}

/** The admission as the agent reads it. */
export function toWire(admission: Admission, method: string): AdmissionRequest {
  const wire: AdmissionRequest = {
    requestId: admission.requestId ?? randomUUID(),
    tenantId: admission.tenantId,
    principal: admission.principal,
    routeGroup: admission.routeGroup,
    method: method.toUpperCase(),
    costHint: admission.cost ?? 1,
  };
  if (admission.metered) wire.metered = true;
  return wire;
}

function undecided(mode: FailMode, warn: (message: string, error: unknown) => void, error: unknown): Outcome {
  if (error instanceof ClientError && error.kind === "invalid") {
    warn("the service's admission breaks the contract", error);
  }
  if (mode === "open") {
    warn("no decision from the agent: let through unlimited (fail open)", error);
    return { kind: "pass" };
  }
  warn("no decision from the agent: refused (fail closed)", error);
  return { kind: "refused", status: 503, headers: { "retry-after": "1" }, problem: UNAVAILABLE };
}

function defaultWarning(message: string, error: unknown): void {
  console.warn(`allot: ${message}: ${error instanceof Error ? error.message : String(error)}`);
}

/** What an admitted request owes the agent when its response ends. Runs once, when the response
 * closes (sent whole, or the caller went away); a heartbeat renewing its slots stops then too. */
export class Completion {
  private done = false;
  private heartbeat: NodeJS.Timeout | undefined;

  constructor(
    private readonly client: AgentClient,
    private readonly request: AdmissionRequest,
    private readonly releasesSlots: boolean,
    private readonly meter: MeteredCost | undefined,
    renewEveryMs: number | undefined,
    private readonly warn: (message: string, error: unknown) => void,
  ) {
    if (releasesSlots && renewEveryMs !== undefined && renewEveryMs > 0) {
      // The next renewal is timed from the end of the last: a slow agent gets one call at a time.
      const beat = (): void => {
        this.heartbeat = setTimeout(() => {
          client
            .renew(request)
            .catch((error) => warn("could not renew a request's concurrency slots", error))
            .finally(() => {
              if (!this.done) beat();
            });
        }, renewEveryMs);
        this.heartbeat.unref();
      };
      beat();
    }
  }

  /** Runs the completion when `response` closes, or now when it already has (the caller went
   * away while the agent was deciding: its `close` is past). */
  when(response: ServerResponse): void {
    if (response.destroyed || response.writableFinished || response.closed) {
      void this.run();
      return;
    }
    response.once("close", () => void this.run());
  }

  /** Gives the slots back and settles the stated cost; once. Never throws. */
  async run(): Promise<void> {
    if (this.done) return;
    this.done = true;
    if (this.heartbeat) clearTimeout(this.heartbeat);
    if (this.releasesSlots) {
      await this.client
        .release(this.request)
        .catch((error) => this.warn("could not release a request's concurrency slots; they lapse with their lease", error));
    }
    const actualCost = this.meter?.get();
    if (actualCost !== undefined) {
      await this.client
        .settle({ decisionId: this.request.requestId, tenantId: this.request.tenantId, actualCost })
        .catch((error) => this.warn("could not settle a metered request; its estimate stands", error));
    }
  }
}

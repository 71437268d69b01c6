// The same scenarios for each framework's middleware, against the real agent: refusals worded as
// the agent words them, slots given back when responses end or are abandoned, metered costs
// settled, and the fail modes without an agent.
import assert from "node:assert/strict";
import { test } from "node:test";

import { AgentClient, type Admission, type FailMode } from "../src/index.js";
import { GATEWAY_TOKEN, TENANT, client, deadUrl, eventually, remaining, slowFront } from "./helpers.js";

/** A service behind the middleware: `/read`; `/export`, whose body stays open until the test
 * closes it; `/summarize`, which states a cost of 30. */
export interface Service {
  url: string;
  /** Requests the routes saw. */
  served(): number;
  /** Holds the next `/export` body open; call the result to end it. */
  holdNextExport(): () => void;
  stop(): Promise<void>;
}

export type StartService = (agent: AgentClient, mode: FailMode) => Promise<Service>;

/** How the test services identify a caller: `x-test-user`, and the route from the path. */
export function identify(user: string | undefined, path: string): Admission | undefined {
  if (!user) return undefined;
  const routeGroup = path.replace(/^\//, "").split("?")[0] ?? "";
  const admission: Admission = { tenantId: TENANT, principal: { type: "user", id: user }, routeGroup };
  if (routeGroup === "export") admission.releasesSlots = true;
  if (routeGroup === "summarize") admission.metered = true;
  return admission;
}

/** A queue of gates for `/export` bodies. */
export class Gates {
  private waiting: Promise<void>[] = [];
  hold(): () => void {
    let open!: () => void;
    this.waiting.push(new Promise<void>((resolve) => (open = resolve)));
    return open;
  }
  next(): Promise<void> {
    return this.waiting.shift() ?? Promise.resolve();
  }
}

async function get(url: string, path: string, who?: string, signal?: AbortSignal): Promise<Response> {
  return fetch(`${url}${path}`, { headers: who ? { "x-test-user": who } : {}, signal: signal ?? null });
}

export function middlewareScenarios(framework: string, start: StartService): void {
  const who = (n: number) => `${framework}-U-${n}`;

  test(`${framework}: admits, and answers refusals as the agent words them`, async () => {
    const agent = client();
    const service = await start(agent, "closed");
    try {
      for (let i = 0; i < 2; i++) {
        const admitted = await get(service.url, "/read", who(2));
        assert.equal(admitted.status, 200);
        assert.equal(admitted.headers.get("ratelimit-policy"), '"reads";q=2;w=60');
        assert.equal(admitted.headers.get("retry-after"), null);
        await admitted.text();
      }
      const refused = await get(service.url, "/read", who(2));
      assert.equal(refused.status, 429);
      assert.equal(refused.headers.get("content-type"), "application/problem+json");
      const seconds = refused.headers.get("retry-after") ?? "";
      assert.match(seconds, /^\d+$/, "whole seconds");
      assert.ok(Number(seconds) >= 1 && Number(seconds) <= 61, seconds); // the window, plus up to 1 s of jitter
      assert.ok(refused.headers.get("ratelimit"));
      assert.equal(((await refused.json()) as { status: number }).status, 429);
      assert.equal(service.served(), 2, "the service saw only admissions");
      // A request identify does not limit goes straight through.
      const anonymous = await get(service.url, "/read");
      assert.equal(anonymous.status, 200);
      await anonymous.text();
      assert.equal(service.served(), 3);
    } finally {
      await service.stop();
      agent.close();
    }
  });

  test(`${framework}: gives slots back when responses end or are abandoned`, async () => {
    const agent = client();
    const service = await start(agent, "closed");
    try {
      let close = service.holdNextExport();
      const first = await get(service.url, "/export", who(3));
      assert.equal(first.status, 200);
      const second = await get(service.url, "/export", who(3));
      assert.equal(second.status, 429, "one at a time");
      await second.text();
      close();
      assert.equal(await first.text(), "export done\n");

      // The body ended: the slot came back. Held open again, then abandoned by the caller.
      service.holdNextExport();
      const abandon = new AbortController();
      await eventually("the slot given back when the body ended", async () => {
        const answer = await get(service.url, "/export", who(3), abandon.signal);
        if (answer.status !== 200) await answer.text();
        return answer.status === 200;
      });
      abandon.abort();
      close = service.holdNextExport();
      await eventually("the slot given back when the caller went away", async () => {
        const answer = await get(service.url, "/export", who(3));
        if (answer.status === 200) close();
        await answer.text();
        return answer.status === 200;
      });
    } finally {
      await service.stop();
      agent.close();
    }
  });

  test(`${framework}: a caller gone while the agent decides still gets its slot given back`, async () => {
    // The agent's answer comes 300 ms late; the caller hangs up after 50 ms, before the admission
    // is known: its response has closed before the middleware could wait for it to.
    const front = await slowFront(300);
    const agent = new AgentClient({ baseUrl: front.url, gatewayToken: GATEWAY_TOKEN, callTimeoutMs: 2000 });
    const service = await start(agent, "closed");
    try {
      service.holdNextExport();
      await assert.rejects(get(service.url, "/export", who(7), AbortSignal.timeout(50)));
      const close = service.holdNextExport();
      await eventually("the slot given back", async () => {
        const answer = await get(service.url, "/export", who(7));
        if (answer.status === 200) close();
        await answer.text();
        return answer.status === 200;
      });
    } finally {
      await service.stop();
      agent.close();
      front.close();
    }
  });

  test(`${framework}: settles the cost a service states`, async () => {
    const agent = client();
    const service = await start(agent, "closed");
    try {
      const answer = await get(service.url, "/summarize", who(4));
      assert.equal(answer.status, 200);
      assert.equal(await answer.text(), "summary\n");
      // Estimated 1, stated 30: 70 of 100 left once settled.
      await eventually("the stated cost settled", async () => (await remaining(agent, who(4), "summaries")) === 70);
    } finally {
      await service.stop();
      agent.close();
    }
  });

  test(`${framework}: without an agent, fails as told`, async () => {
    const unreachable = new AgentClient({ baseUrl: await deadUrl(), gatewayToken: GATEWAY_TOKEN, callTimeoutMs: 300 });
    const closed = await start(unreachable, "closed");
    try {
      const refused = await get(closed.url, "/read", who(5));
      assert.equal(refused.status, 503);
      assert.equal(refused.headers.get("retry-after"), "1");
      assert.equal(refused.headers.get("content-type"), "application/problem+json");
      await refused.text();
      assert.equal(closed.served(), 0);
    } finally {
      await closed.stop();
    }
    const open = await start(unreachable, "open");
    try {
      const through = await get(open.url, "/read", who(5));
      assert.equal(through.status, 200);
      await through.text();
      assert.equal(open.served(), 1);
    } finally {
      await open.stop();
      unreachable.close();
    }
  });
}

// What the tests share: the real agent the harness started (clients/rust/tests/integration/other_languages.rs
// starts it on a real Redis with the bundle its comment describes), and small tools.
//
// The bundle: `read` 2 a minute per user; `export` one at a time per user; `summarize` a bucket
// of 100 units per user refilled in an hour; `orders` 10 an hour per user, idempotent by request id.
import * as http from "node:http";
import type { AddressInfo } from "node:net";

import { AgentClient, type AdmissionRequest, type ClientOptions } from "../src/index.js";

function required(name: string): string {
  const value = process.env[name];
  if (!value) {
    throw new Error(`${name} is not set: these tests run against a real agent; run them through \`cargo nextest run -p allot-client -E 'test(/^other_languages::/)'\``);
  }
  return value;
}

export const AGENT_URL = required("ALLOT_AGENT_URL");
export const GATEWAY_TOKEN = required("ALLOT_GATEWAY_TOKEN");
export const TENANT = "atlas";

export function client(options: Partial<ClientOptions> = {}): AgentClient {
  return new AgentClient({ baseUrl: AGENT_URL, gatewayToken: GATEWAY_TOKEN, callTimeoutMs: 2000, ...options });
}

export function request(requestId: string, who: string, routeGroup: string): AdmissionRequest {
  return { requestId, tenantId: TENANT, principal: { type: "user", id: who }, routeGroup, method: "GET", costHint: 1 };
}

/** What is left of `who`'s quota under `rule`, as the agent says. */
export async function remaining(agent: AgentClient, who: string, rule: string): Promise<number | null | undefined> {
  const status = await agent.quota({ tenantId: TENANT, principalType: "user", principalId: who });
  return status.quotas.find((line) => line.policyId === rule)?.remaining;
}

/** Polls `condition` every 20 ms for up to 5 s of wall time, however long each poll takes
 * (completions run after the response ends). */
export async function eventually(what: string, condition: () => Promise<boolean>): Promise<void> {
  const deadline = Date.now() + 5_000;
  while (Date.now() < deadline) {
    if (await condition()) return;
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
  throw new Error(`not within 5 s: ${what}`);
}

/** A server on a free loopback port; its URL. */
export async function listen(server: http.Server): Promise<string> {
  await new Promise<void>((resolve) => server.listen(0, "127.0.0.1", resolve));
  return `http://127.0.0.1:${(server.address() as AddressInfo).port}`;
}

/** A URL nothing listens on. */
export async function deadUrl(): Promise<string> {
  const server = http.createServer();
  const url = await listen(server);
  await new Promise((resolve) => server.close(resolve));
  return url;
}

/** Between a client and the agent: passes every call on, and answers the first with 502 after the
 * agent has decided it (an answer lost on the way back). Records each body's requestId. */
export async function lossyFront(): Promise<{ url: string; seen: string[]; close: () => void }> {
  const seen: string[] = [];
  const server = http.createServer(async (incoming, outgoing) => {
    const chunks: Buffer[] = [];
    for await (const chunk of incoming) chunks.push(chunk as Buffer);
    const body = Buffer.concat(chunks);
    const answer = await fetch(`${AGENT_URL}${incoming.url}`, {
      method: incoming.method,
      headers: { authorization: incoming.headers.authorization ?? "", "content-type": "application/json" },
      body: body.length > 0 ? body : undefined,
    });
    const text = await answer.text();
    try {
      seen.push((JSON.parse(body.toString("utf8")) as { requestId: string }).requestId);
    } catch {
      seen.push("");
    }
    if (seen.length === 1) {
      outgoing.writeHead(502).end();
    } else {
      outgoing.writeHead(answer.status, { "content-type": answer.headers.get("content-type") ?? "" }).end(text);
    }
  });
  const url = await listen(server);
  return { url, seen, close: () => server.close() };
}

/** Between a client and the agent: passes every call on, `/v1/check` answered `delayMs` late. */
export async function slowFront(delayMs: number): Promise<{ url: string; close: () => void }> {
  const server = http.createServer(async (incoming, outgoing) => {
    const chunks: Buffer[] = [];
    for await (const chunk of incoming) chunks.push(chunk as Buffer);
    const body = Buffer.concat(chunks);
    const answer = await fetch(`${AGENT_URL}${incoming.url}`, {
      method: incoming.method,
      headers: { authorization: incoming.headers.authorization ?? "", "content-type": "application/json" },
      body: body.length > 0 ? body : undefined,
    });
    const text = await answer.text();
    if (incoming.url === "/v1/check") await new Promise((resolve) => setTimeout(resolve, delayMs));
    const headers: Record<string, string> = {};
    answer.headers.forEach((value, name) => {
      if (name !== "content-length" && name !== "transfer-encoding" && name !== "connection") headers[name] = value;
    });
    outgoing.writeHead(answer.status, headers).end(text);
  });
  const url = await listen(server);
  return {
    url,
    close: () => {
      server.closeAllConnections();
      server.close();
    },
  };
}

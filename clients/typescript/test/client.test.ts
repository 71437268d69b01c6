// The client against a real agent: every endpoint, refusals, bad input refused before it is sent,
// retries that keep their request id, and calls bounded when no agent answers.
import assert from "node:assert/strict";
import * as http from "node:http";
import { inspect } from "node:util";
import { after, test } from "node:test";

import { AgentClient, ClientError, MAX_ATTEMPTS, retryAfterSeconds } from "../src/index.js";
import { AGENT_URL, GATEWAY_TOKEN, client, deadUrl, listen, lossyFront, remaining, request } from "./helpers.js";

const agent = client();
after(() => agent.close());

test("the client speaks every endpoint", async () => {
  assert.equal(await agent.healthz(), true);
  const ready = await agent.readyz();
  assert.equal(ready.ready, true, ready.detail);

  const decision = await agent.admit(request("ts-a-1", "ts-U-1", "read"));
  assert.equal(decision.allowed, true);
  assert.equal(decision.decisionId, "ts-a-1");
  assert.equal(decision.remaining, 1);

  const checked = await agent.check(request("ts-a-2", "ts-U-1", "read"));
  assert.equal(checked.status, 200);
  assert.equal(checked.callerHeaders["ratelimit-policy"], '"reads";q=2;w=60');
  const refused = await agent.check(request("ts-a-3", "ts-U-1", "read"));
  assert.equal(refused.allowed, false);
  assert.equal(refused.status, 429);
  assert.equal(refused.problem?.status, 429);
  const wait = retryAfterSeconds(refused);
  // The minute's window, plus up to 1 s of jitter.
  assert.ok(wait !== undefined && wait >= 1 && wait <= 61, `Retry-After ${wait}`);
  assert.equal((await agent.admit(request("ts-a-4", "ts-U-1", "read"))).allowed, false);

  // A slot held, renewed and given back.
  const exporting = request("ts-e-1", "ts-U-1", "export");
  assert.equal((await agent.check(exporting)).allowed, true);
  assert.equal((await agent.check(request("ts-e-2", "ts-U-1", "export"))).allowed, false, "one at a time");
  assert.equal((await agent.renew(exporting)).renewed, 1);
  await agent.release(exporting);
  await agent.release(exporting); // idempotent
  assert.equal((await agent.check(request("ts-e-3", "ts-U-1", "export"))).allowed, true);

  // A metered admission: estimated 1, settled at 30.
  const summary = { ...request("ts-s-1", "ts-U-1", "summarize"), metered: true };
  const metered = await agent.check(summary);
  assert.equal(metered.allowed, true);
  assert.ok((metered.settleByMs ?? 0) > Date.now(), "a settle deadline ahead");
  const settled = await agent.settle({ decisionId: "ts-s-1", tenantId: "atlas", actualCost: 30 });
  assert.deepEqual([settled.estimate, settled.actualCost, settled.extra], [1, 30, 29]);
  assert.equal(await remaining(agent, "ts-U-1", "summaries"), 70);
  await assert.rejects(agent.settle({ decisionId: "ts-s-1", tenantId: "atlas", actualCost: 31 }), (error: ClientError) => {
    assert.equal(error.kind, "refused");
    assert.equal(error.status, 409, "settled before with another cost");
    return true;
  });
  await assert.rejects(agent.settle({ decisionId: "ts-none", tenantId: "atlas", actualCost: 3 }), { status: 404 });

  const quota = await agent.quota({ tenantId: "atlas", principalType: "user", principalId: "ts-U-1", routeGroup: "read" });
  assert.deepEqual(quota.quotas.map((line) => [line.policyId, line.remaining]), [["reads", 0]]);
  assert.match(await agent.metrics(), /allot_/);
  assert.equal((await agent.openapi()).openapi, "3.1.0");
});

test("bad input is refused before it is sent, naming the field", async () => {
  const cases: [object, string][] = [
    [{ requestId: "has space" }, "requestId"],
    [{ requestId: "" }, "requestId"],
    [{ tenantId: "Atlas" }, "tenantId"],
    [{ routeGroup: "a".repeat(33) }, "routeGroup"],
    [{ costHint: 0 }, "costHint"],
    [{ costHint: 2 ** 30 + 1 }, "costHint"],
    [{ costHint: 1.5 }, "costHint"],
    [{ principal: { type: "user", id: "" } }, "principal.id"],
    [{ dryRun: true, metered: true }, "metered"],
  ];
  const front = await lossyFront();
  const watched = new AgentClient({ baseUrl: front.url, gatewayToken: GATEWAY_TOKEN });
  try {
    for (const [change, field] of cases) {
      await assert.rejects(watched.admit({ ...request("ts-b-1", "ts-U-2", "read"), ...change }), (error: ClientError) => {
        assert.equal(error.kind, "invalid", JSON.stringify(change));
        assert.equal(error.field, field);
        return true;
      });
    }
    assert.deepEqual(front.seen, [], "nothing was sent");
    await assert.rejects(watched.settle({ decisionId: "x", tenantId: "atlas", actualCost: -1 }), { field: "actualCost" });
  } finally {
    watched.close();
    front.close();
  }
});

test("a refusal of the call itself is an answer, never retried", async () => {
  const wrongToken = new AgentClient({ baseUrl: AGENT_URL, gatewayToken: "not-a-gateway-token", maxAttempts: 3 });
  await assert.rejects(wrongToken.admit(request("ts-t-1", "ts-U-3", "read")), (error: ClientError) => {
    assert.equal(error.kind, "refused");
    assert.equal(error.status, 401);
    assert.equal(error.problem?.status, 401);
    return true;
  });
  assert.equal(wrongToken.retries, 0);
  assert.doesNotMatch(JSON.stringify(wrongToken), /not-a-gateway-token/, "the token never shows");
  assert.doesNotMatch(inspect(wrongToken), /not-a-gateway-token/, "not even to console.log");
  wrongToken.close();
});

test("a retry keeps its request id, so an idempotent rule charges once", async () => {
  const front = await lossyFront();
  const retried = new AgentClient({ baseUrl: front.url, gatewayToken: GATEWAY_TOKEN, callTimeoutMs: 2000, maxAttempts: 2 });
  try {
    const decision = await retried.admit(request("ts-o-1", "ts-U-6", "orders"));
    assert.equal(decision.allowed, true);
    assert.deepEqual(front.seen, ["ts-o-1", "ts-o-1"], "the retry kept the request id");
    assert.equal(retried.retries, 1);
    assert.equal(await remaining(agent, "ts-U-6", "orders"), 9, "charged once");
  } finally {
    retried.close();
    front.close();
  }
});

test("without an answer a call is bounded in attempts and time", { timeout: 10_000 }, async () => {
  const dead = new AgentClient({ baseUrl: await deadUrl(), gatewayToken: GATEWAY_TOKEN, maxAttempts: 3, retryBackoffMs: 1 });
  await assert.rejects(dead.admit(request("ts-d-1", "ts-U-4", "read")), (error: ClientError) => {
    assert.equal(error.kind, "unreachable");
    assert.equal(error.attempts, 3);
    return true;
  });
  assert.equal(dead.retries, 2);

  // A server that accepts and never answers: each attempt ends at the call timeout.
  const silent = http.createServer(() => {});
  const url = await listen(silent);
  const slow = new AgentClient({ baseUrl: url, gatewayToken: GATEWAY_TOKEN, callTimeoutMs: 100, maxAttempts: 2, retryBackoffMs: 1 });
  const started = Date.now();
  await assert.rejects(slow.check(request("ts-d-2", "ts-U-4", "read")), /no answer within 100 ms/);
  const elapsedMs = Date.now() - started;
  assert.ok(elapsedMs >= 200 && elapsedMs < 2_000, `two attempts of 100 ms, not ${elapsedMs} ms`);
  slow.close();
  silent.closeAllConnections();
  silent.close();
});

test("a client that cannot be bounded is not built", () => {
  const build = (options: object) => () =>
    new AgentClient({ baseUrl: "http://agent:7701", gatewayToken: "t", ...options });
  assert.throws(build({ baseUrl: "agent:7701" }), /http:\/\//);
  assert.throws(build({ gatewayToken: " " }), /token/);
  // A token no header can carry is refused without being echoed.
  assert.throws(build({ gatewayToken: "first\nsecond" }), (error: Error) => /visible ASCII/.test(error.message) && !/first/.test(error.message));
  assert.throws(build({ maxAttempts: 0 }), /attempts/);
  assert.throws(build({ maxAttempts: MAX_ATTEMPTS + 1 }), /attempts/);
  assert.throws(build({ callTimeoutMs: 0 }), /timeout/);
  assert.throws(build({ callTimeoutMs: 60_000 }), /timeout/);
  assert.equal(new AgentClient({ baseUrl: "http://agent:7701/", gatewayToken: "t" }).baseUrl, "http://agent:7701");
});

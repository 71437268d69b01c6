// The example service (examples/service.ts) against the real agent: a known API key is admitted as
// its client and its metered summary settled at the stated cost.
import assert from "node:assert/strict";
import { createServer } from "node:http";
import { test } from "node:test";

import { createApp } from "../examples/service.js";
import { client, eventually, listen } from "./helpers.js";

test("the example service admits a known key and settles what it states", async () => {
  const agent = client();
  const server = createServer(createApp(agent, "atlas", new Map([["key-one", "ts-example-client"]])));
  const url = await listen(server);
  try {
    const reports = await fetch(`${url}/reports`, { headers: { "x-api-key": "key-one" } });
    assert.equal(reports.status, 200);
    assert.equal(reports.headers.get("ratelimit-policy"), '"reads";q=2;w=60');
    const summary = await fetch(`${url}/summaries`, {
      method: "POST",
      headers: { "x-api-key": "key-one", "content-type": "text/plain" },
      body: "one two three",
    });
    assert.equal(await summary.text(), "3 words\n");
    const quota = async () =>
      (await agent.quota({ tenantId: "atlas", principalType: "api_key", principalId: "ts-example-client" })).quotas.find(
        (line) => line.policyId === "summaries",
      )?.remaining;
    // Estimated 1, stated 8 (the answer's length): 92 of 100 left.
    await eventually("the summary settled at its stated cost", async () => (await quota()) === 92);
  } finally {
    server.closeAllConnections();
    server.close();
    agent.close();
  }
});

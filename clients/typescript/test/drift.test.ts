// The client held equal to the agent's own OpenAPI document (`GET /openapi.json` of the real
// agent): the generated wire types, the field rules it checks before sending, and an endpoint for
// every path a service calls.
import assert from "node:assert/strict";
import { readFile } from "node:fs/promises";
import { test } from "node:test";

import { AgentClient, FIELD_RULES } from "../src/index.js";
import { client } from "./helpers.js";

type Schema = Record<string, unknown>;

async function document(): Promise<Schema> {
  const agent = client();
  try {
    return await agent.openapi();
  } finally {
    agent.close();
  }
}

test("the wire types are generated from the agent's document as it is now", async () => {
  const generator = new URL("../../scripts/agent-api-source.mjs", import.meta.url).href;
  const { agentApiSource } = (await import(generator)) as { agentApiSource: (document: Schema) => Promise<string> };
  const committed = await readFile(new URL("../../src/agent-api.ts", import.meta.url), "utf8");
  const fresh = await agentApiSource(await document());
  assert.ok(
    fresh === committed,
    "src/agent-api.ts differs from the agent's /openapi.json: run `npm run generate` against an agent and review the change",
  );
});

/** The schema of `Schema.field`, its `$ref` followed, its `oneOf` with `null` unwrapped. */
function property(doc: Schema, key: string): Schema {
  const [schemaName, field] = key.split(".") as [string, string];
  const schemas = (doc.components as { schemas: Record<string, Schema> }).schemas;
  const resolve = (schema: Schema): Schema => {
    if (typeof schema.$ref === "string") return resolve(schemas[schema.$ref.split("/").pop() ?? ""] ?? {});
    const variants = (schema.oneOf ?? schema.anyOf) as Schema[] | undefined;
    const concrete = variants?.filter((variant) => variant.type !== "null");
    if (concrete?.length === 1 && concrete[0]) return resolve(concrete[0]);
    return schema;
  };
  const owner = schemas[schemaName];
  assert.ok(owner, `no schema ${schemaName} in the agent's document`);
  const found = (owner.properties as Record<string, Schema> | undefined)?.[field];
  assert.ok(found, `no field ${key} in the agent's document`);
  return resolve(found);
}

test("the rules checked before sending are the document's", async () => {
  const doc = await document();
  for (const [key, rule] of Object.entries(FIELD_RULES)) {
    const schema = property(doc, key);
    for (const constraint of ["pattern", "minLength", "maxLength", "minimum", "maximum"] as const) {
      assert.equal(rule[constraint], schema[constraint], `${key}.${constraint}: the client checks ${rule[constraint]}, the agent's document says ${schema[constraint]}`);
    }
  }
});

/** What services call: every path but nginx's subrequest (`/v1/auth-request`, which nginx reads). */
const CLIENT_METHOD: Record<string, keyof AgentClient> = {
  "POST /v1/admit": "admit",
  "POST /v1/check": "check",
  "POST /v1/release": "release",
  "POST /v1/renew": "renew",
  "POST /v1/settle": "settle",
  "GET /v1/quota": "quota",
  "GET /healthz": "healthz",
  "GET /readyz": "readyz",
  "GET /metrics": "metrics",
  "GET /openapi.json": "openapi",
};

test("every endpoint of the document has a client method", async () => {
  const doc = await document();
  const operations = Object.entries(doc.paths as Record<string, Record<string, unknown>>).flatMap(([path, item]) =>
    Object.keys(item).map((method) => `${method.toUpperCase()} ${path}`),
  );
  const served = operations.filter((operation) => operation !== "GET /v1/auth-request").sort();
  assert.deepEqual(served, Object.keys(CLIENT_METHOD).sort());
  for (const name of Object.values(CLIENT_METHOD)) {
    assert.equal(typeof AgentClient.prototype[name], "function", name);
  }
});

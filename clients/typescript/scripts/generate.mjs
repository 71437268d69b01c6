// Writes src/agent-api.ts, the agent's wire types, from its OpenAPI document: the running agent's
// (ALLOT_AGENT_URL, e.g. http://127.0.0.1:7701) or a saved file (the first argument).
// The drift test regenerates them from a real agent and fails when they differ.
import { readFile, writeFile } from "node:fs/promises";
import { agentApiSource } from "./agent-api-source.mjs";

const from = process.argv[2];
let document;
if (from) {
  document = JSON.parse(await readFile(from, "utf8"));
} else if (process.env.ALLOT_AGENT_URL) {
  const answer = await fetch(`${process.env.ALLOT_AGENT_URL.replace(/\/$/, "")}/openapi.json`);
  if (!answer.ok) throw new Error(`GET /openapi.json answered ${answer.status}`);
  document = await answer.json();
} else {
  console.error("usage: npm run generate -- <openapi.json>   (or set ALLOT_AGENT_URL)");
  process.exit(2);
}
await writeFile(new URL("../src/agent-api.ts", import.meta.url), await agentApiSource(document));
console.log("wrote src/agent-api.ts");

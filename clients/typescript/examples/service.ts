// An Express service whose every request the region agent admits first.
//
//   ALLOT_AGENT_URL=https://agent.eu.internal:7701 ALLOT_AGENT_CA=/etc/allot/ca.pem \
//   ALLOT_GATEWAY_TOKEN_FILE=/run/secrets/allot-gateway-token \
//   ALLOT_API_KEYS='key-one=client-1,key-two=client-2' ALLOT_TENANT=atlas \
//     npm run build && npm run example -- 127.0.0.1:3000
//
// Callers present `X-Api-Key`; a listed key is the verified client (principal `api_key`), any other
// caller is anonymous (principal `ip`, its address). `GET /reports` is a `read`, `POST /exports`
// holds a concurrency slot until its response ends, and `POST /summaries` is metered: it charges 1
// up front and states its actual cost (the length of its answer) at the end.
import express from "express";
import { readFileSync } from "node:fs";
import type { IncomingMessage } from "node:http";
import { pathToFileURL } from "node:url";

import { type Admission, AgentClient, allotExpress, allotOf } from "../src/index.js";

/** The service, behind the agent `client`, for `tenantId`, accepting `apiKeys` (key -> client id). */
export function createApp(client: AgentClient, tenantId: string, apiKeys: Map<string, string>): express.Express {
  const identify = (request: express.Request): Admission => {
    const key = request.header("x-api-key");
    const known = key === undefined ? undefined : apiKeys.get(key);
    const principal = known
      ? { type: "api_key" as const, id: known }
      : { type: "ip" as const, id: (request as IncomingMessage).socket.remoteAddress ?? "unknown" };
    const routeGroup = request.path === "/exports" ? "export" : request.path === "/summaries" ? "summarize" : "read";
    return { tenantId, principal, routeGroup, releasesSlots: routeGroup === "export", metered: routeGroup === "summarize" };
  };
  const app = express();
  app.use(allotExpress({ client, identify, whenUndecided: "closed" }));
  app.get("/reports", (_request, response) => {
    response.send("reports\n");
  });
  app.post("/exports", (_request, response) => {
    response.send("export started\n");
  });
  app.post("/summaries", express.text(), (request, response) => {
    const words = String(request.body ?? "").split(/\s+/).filter(Boolean).length;
    const answer = `${words} words\n`;
    // The actual cost, settled when the response ends.
    allotOf(request)?.meter?.set(answer.length);
    response.send(answer);
  });
  return app;
}

function setting(name: string): string {
  const value = process.env[name];
  if (!value) {
    console.error(`set ${name}`);
    process.exit(2);
  }
  return value;
}

if (import.meta.url === pathToFileURL(process.argv[1] ?? "").href) {
  const [host, port] = (process.argv[2] ?? "127.0.0.1:3000").split(":");
  const ca = process.env.ALLOT_AGENT_CA;
  const client = new AgentClient({
    baseUrl: setting("ALLOT_AGENT_URL"),
    gatewayToken: readFileSync(setting("ALLOT_GATEWAY_TOKEN_FILE"), "utf8"),
    ...(ca ? { ca: readFileSync(ca) } : {}),
  });
  const apiKeys = new Map(
    setting("ALLOT_API_KEYS")
      .split(",")
      .map((pair) => pair.split("=") as [string, string])
      .filter((pair) => pair.length === 2),
  );
  createApp(client, setting("ALLOT_TENANT"), apiKeys).listen(Number(port), host ?? "127.0.0.1", () => {
    console.log(`listening on ${host}:${port}`);
  });
}

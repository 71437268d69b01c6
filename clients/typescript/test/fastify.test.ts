// The Fastify hook against the real agent.
import Fastify from "fastify";

import { type AgentClient, type FailMode, allotOf } from "../src/index.js";
import { allotFastify } from "../src/fastify.js";
import { Gates, type Service, identify, middlewareScenarios } from "./middleware.js";

async function start(agent: AgentClient, mode: FailMode): Promise<Service> {
  let served = 0;
  const gates = new Gates();
  const app = Fastify();
  app.addHook(
    "onRequest",
    allotFastify({
      client: agent,
      identify: (request) => identify(request.headers["x-test-user"] as string | undefined, request.url),
      whenUndecided: mode,
      onWarning: () => {},
    }),
  );
  app.get("/read", async () => {
    served++;
    return "read\n";
  });
  app.get("/export", async (_request, reply) => {
    served++;
    reply.hijack();
    reply.raw.writeHead(200, { "content-type": "text/plain" });
    reply.raw.flushHeaders();
    await gates.next();
    reply.raw.end("export done\n");
  });
  app.get("/summarize", async (request) => {
    served++;
    allotOf(request.raw)?.meter?.set(30);
    return "summary\n";
  });
  const url = await app.listen({ port: 0, host: "127.0.0.1" });
  return {
    url,
    served: () => served,
    holdNextExport: () => gates.hold(),
    stop: async () => {
      app.server.closeAllConnections();
      await app.close();
    },
  };
}

middlewareScenarios("fastify", start);

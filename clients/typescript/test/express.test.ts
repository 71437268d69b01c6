// The Express middleware against the real agent.
import express from "express";
import { createServer } from "node:http";

import { type AgentClient, type FailMode, allotExpress, allotOf } from "../src/index.js";
import { listen } from "./helpers.js";
import { Gates, type Service, identify, middlewareScenarios } from "./middleware.js";

async function start(agent: AgentClient, mode: FailMode): Promise<Service> {
  let served = 0;
  const gates = new Gates();
  const app = express();
  app.use(
    allotExpress({
      client: agent,
      identify: (request) => identify(request.header("x-test-user"), request.path),
      whenUndecided: mode,
      onWarning: () => {},
    }),
  );
  app.get("/read", (_request, response) => {
    served++;
    response.send("read\n");
  });
  app.get("/export", async (_request, response) => {
    served++;
    response.flushHeaders();
    await gates.next();
    response.end("export done\n");
  });
  app.get("/summarize", (request, response) => {
    served++;
    allotOf(request)?.meter?.set(30);
    response.send("summary\n");
  });
  const server = createServer(app);
  const url = await listen(server);
  return {
    url,
    served: () => served,
    holdNextExport: () => gates.hold(),
    stop: async () => {
      server.closeAllConnections();
      await new Promise((resolve) => server.close(resolve));
    },
  };
}

middlewareScenarios("express", start);

// Express middleware: admits each request before the routes see it. Admitted, the request goes on
// with `RateLimit` fields on its response; refused, the caller gets the agent's 429 or 503
// problem+json with `Retry-After`; without a decision, the fail mode says which.
import type { IncomingMessage, ServerResponse } from "node:http";

import { type MiddlewareOptions, PROBLEM_CONTENT_TYPE, decide, markAdmitted } from "./admission.js";

/** Express middleware: `app.use(allotExpress({ client, identify }))`. */
export function allotExpress<Request extends IncomingMessage>(
  options: MiddlewareOptions<Request>,
): (request: Request, response: ServerResponse, next: (error?: unknown) => void) => void {
  return (request, response, next) => {
    decide(options, request, request.method ?? "GET")
      .then((outcome) => {
      switch (outcome.kind) {
        case "pass":
          return next();
        case "refused":
          response.statusCode = outcome.status;
          for (const [name, value] of Object.entries(outcome.headers)) response.setHeader(name, value);
          response.setHeader("content-type", PROBLEM_CONTENT_TYPE);
          response.end(JSON.stringify(outcome.problem));
          return;
        case "admitted":
          markAdmitted(request, outcome.admitted);
          for (const [name, value] of Object.entries(outcome.headers)) response.setHeader(name, value);
          outcome.complete?.when(response);
          return next();
      }
      })
      .catch(next);
  };
}

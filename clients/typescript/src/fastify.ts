// Fastify hook and plugin: admits each request before its route handler runs (onRequest). Answers
// as the Express middleware does (src/express.ts); the same decisions (src/admission.ts).
import type { FastifyInstance, FastifyReply, FastifyRequest } from "fastify";

import { type MiddlewareOptions, PROBLEM_CONTENT_TYPE, decide, markAdmitted } from "./admission.js";

/** An `onRequest` hook: `app.addHook("onRequest", allotFastify({ client, identify }))`.
 * `identify` gets Fastify's request; `allotOf(request.raw)` reads an admission. */
export function allotFastify(
  options: MiddlewareOptions<FastifyRequest>,
): (request: FastifyRequest, reply: FastifyReply) => Promise<FastifyReply | undefined> {
  return async (request, reply) => {
    const outcome = await decide(options, request, request.method);
    switch (outcome.kind) {
      case "pass":
        return;
      case "refused":
        reply.code(outcome.status);
        for (const [name, value] of Object.entries(outcome.headers)) reply.header(name, value);
        reply.header("content-type", PROBLEM_CONTENT_TYPE);
        // Answered early: returning the reply tells Fastify the request stops here.
        return reply.send(Buffer.from(JSON.stringify(outcome.problem)));
      case "admitted":
        markAdmitted(request.raw, outcome.admitted);
        for (const [name, value] of Object.entries(outcome.headers)) reply.header(name, value);
        outcome.complete?.when(reply.raw);
        return;
    }
  };
}

/** The same as a plugin that applies to the whole instance: `app.register(allotPlugin, { client, identify })`. */
export const allotPlugin = Object.assign(
  function allotPlugin(
    app: FastifyInstance,
    options: MiddlewareOptions<FastifyRequest>,
    done: (error?: Error) => void,
  ): void {
    app.addHook("onRequest", allotFastify(options));
    done();
  },
  // As fastify-plugin marks it: the hook applies outside the plugin's own scope too.
  { [Symbol.for("skip-override")]: true },
);


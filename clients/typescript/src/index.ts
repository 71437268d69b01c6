// Allot's region agent, from Node services: a typed client of every gateway endpoint, and
// middleware for Express and Fastify that admits each request, answers refusals as the agent words
// them, and gives slots back and settles metered costs when the response ends. Fastify's hook is
// at `@allot/client/fastify`, so that services without Fastify need not have its types.
export {
  AgentClient,
  type Checked,
  ClientError,
  type ClientOptions,
  CALLER_HEADERS,
  DEFAULT_CALL_TIMEOUT_MS,
  DEFAULT_MAX_ATTEMPTS,
  DEFAULT_RETRY_BACKOFF_MS,
  MAX_ANSWER_BYTES,
  MAX_ATTEMPTS,
  MAX_CALL_TIMEOUT_MS,
  retryAfterSeconds,
} from "./client.js";
export {
  type Admission,
  type Admitted,
  type FailMode,
  type Identify,
  MeteredCost,
  type MiddlewareOptions,
  allotOf,
} from "./admission.js";
export { allotExpress } from "./express.js";
export * from "./wire.js";

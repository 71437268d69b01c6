// The source of src/agent-api.ts for an OpenAPI document: one function, so that the generator and
// the drift test cannot disagree on how the file is made.
import openapiTS, { astToString } from "openapi-typescript";

const HEADER = `// The region agent's wire types, generated from its OpenAPI document by openapi-typescript.
// Do not edit: run \`npm run generate\` against an agent (the drift test fails when this differs).
`;

export async function agentApiSource(document) {
  const ast = await openapiTS(document, { alphabetize: true });
  return HEADER + astToString(ast);
}

// tokenserve's InferenceService for Node.js, loaded from the repository's .proto files (no
// generated code): `connect(target, apiKey)` returns a client whose `chat` and `generate`
// are async iterators of chunks ({text, tokenIds, finishReason, usage, requestId}).
"use strict";

const path = require("path");
const grpc = require("@grpc/grpc-js");
const protoLoader = require("@grpc/proto-loader");

const PROTOS = path.resolve(__dirname, "..", "..", "protos");
const definition = protoLoader.loadSync(path.join(PROTOS, "tokenserve/gateway/v1/gateway.proto"), {
  includeDirs: [PROTOS],
  keepCase: true, // field names as in the .proto (max_tokens, token_ids)
  longs: Number,
  enums: String, // finish_reason: "FINISH_REASON_STOP"
  defaults: false,
});
const { InferenceService } = grpc.loadPackageDefinition(definition).tokenserve.gateway.v1;

function chunk(resp) {
  return {
    text: resp.text || "",
    tokenIds: resp.token_ids || [],
    finishReason: resp.finish_reason || null,
    usage: resp.usage || null,
    requestId: resp.request_id || "",
    modelVersion: resp.model_version || "",
  };
}

// A failed call: code (grpc status number), details, and retryAfterMs for limits.
class TokenserveError extends Error {
  constructor(err) {
    super(err.details || err.message);
    this.name = "TokenserveError";
    this.code = err.code;
    const retry = err.metadata && err.metadata.get("retry-after-ms")[0];
    this.retryAfterMs = retry === undefined ? null : Number(retry);
  }
}

async function* stream(call) {
  try {
    for await (const resp of call) yield chunk(resp);
  } catch (err) {
    throw new TokenserveError(err);
  } finally {
    call.cancel(); // no-op when finished; stops the server's work when left early
  }
}

function connect(target, apiKey = process.env.TOKENSERVE_API_KEY, { timeoutSeconds = 30 } = {}) {
  if (!apiKey) throw new Error("no API key: pass one or set TOKENSERVE_API_KEY");
  const client = new InferenceService(target, grpc.credentials.createInsecure());
  const metadata = () => {
    const md = new grpc.Metadata();
    md.set("authorization", `Bearer ${apiKey}`);
    return md;
  };
  const deadline = () => new Date(Date.now() + timeoutSeconds * 1000);
  return {
    chat: (messages, options = {}) =>
      stream(client.Chat({ messages, max_tokens: 128, ...options }, metadata(), { deadline: deadline() })),
    generate: (prompt, options = {}) =>
      stream(client.Generate({ prompt, max_tokens: 128, ...options }, metadata(), { deadline: deadline() })),
    close: () => client.close(),
  };
}

module.exports = { connect, TokenserveError };

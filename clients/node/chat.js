#!/usr/bin/env node
// Streams one chat reply to stdout, then the usage to stderr:
//   TOKENSERVE_API_KEY=ts-... node chat.js [host:port] "What is the capital of France?"
// With --json, prints one JSON line {text, usage, finishReason, requestId} instead.
"use strict";

const { connect, TokenserveError } = require("./tokenserve");

async function main(argv) {
  const json = argv.includes("--json");
  const [target = "127.0.0.1:50051", question = "What is the capital of France?"] =
    argv.filter((a) => a !== "--json");
  const client = connect(target);
  let text = "";
  let last = null;
  try {
    for await (const c of client.chat([{ role: "user", content: question }], { max_tokens: 32 })) {
      text += c.text;
      if (!json) process.stdout.write(c.text);
      last = c;
    }
  } finally {
    client.close();
  }
  if (json) {
    console.log(JSON.stringify({ text, usage: last.usage, finishReason: last.finishReason,
                                 requestId: last.requestId }));
  } else {
    process.stderr.write(`\n[${last.finishReason}] usage: ${JSON.stringify(last.usage)}\n`);
  }
}

main(process.argv.slice(2)).catch((err) => {
  const code = err instanceof TokenserveError ? ` (grpc code ${err.code})` : "";
  console.error(`error${code}: ${err.message}`);
  process.exit(1);
});

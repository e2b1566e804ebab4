// Streams one chat through tokenserve with the official openai npm package and prints what it
// got as one JSON line. Env: TOKENSERVE_BASE_URL (.../v1), TOKENSERVE_API_KEY.
import OpenAI from "openai";

const client = new OpenAI({
  baseURL: process.env.TOKENSERVE_BASE_URL,
  apiKey: process.env.TOKENSERVE_API_KEY,
  maxRetries: 0,
});

const stream = await client.chat.completions.create({
  model: "",
  messages: [{ role: "user", content: "What is the capital of France?" }],
  max_tokens: 24,
  temperature: 0,
  stream: true,
  stream_options: { include_usage: true },
});
let text = "";
let usage = null;
let finish = null;
for await (const chunk of stream) {
  if (chunk.choices.length) {
    text += chunk.choices[0].delta.content ?? "";
    finish = chunk.choices[0].finish_reason ?? finish;
  }
  if (chunk.usage) usage = chunk.usage;
}

let error = null;
try {
  await new OpenAI({ baseURL: process.env.TOKENSERVE_BASE_URL, apiKey: "ts-wrong", maxRetries: 0 })
    .models.list();
} catch (e) {
  error = { name: e.constructor.name, status: e.status };
}
console.log(JSON.stringify({ text, usage, finish, error }));

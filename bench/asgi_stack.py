"""Which ASGI stack the HTTP front uses: Starlette vs FastAPI on uvicorn, measured.

    python bench/asgi_stack.py [--runs 5] [--requests 400] [--tokens 200]

Each stack serves the same two endpoints in its own `uvicorn` process (httptools, asyncio):
`POST /v1/chat/completions` parsing a chat body into a pydantic model and answering JSON, and
the same with `stream: true` answering `--tokens` SSE chunks. A raw ASGI app (no framework,
`json` parsing only) is the floor. The client is one keep-alive `http.client` connection,
sequential. Per request: p50 latency; per streamed token: (stream time - request time) /
tokens. Writes bench/results/asgi_stack.json (medians of the runs, CPU flags).
"""
from __future__ import annotations

import argparse
import http.client
import json
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

from tokenserve.runtime.ports import free_port  # noqa: E402

RESULTS = ROOT / "bench" / "results"

APPS = {"raw": '''
import json
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    body = b""
    while True:
        m = await receive()
        body += m.get("body", b"")
        if not m.get("more_body"):
            break
    req = json.loads(body)
    if req.get("stream"):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream")]})
        for i in range(req["max_tokens"]):
            data = json.dumps({"choices": [{"index": 0, "delta": {"content": "tok"}}]})
            await send({"type": "http.response.body", "body": f"data: {data}\\n\\n".encode(),
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\\n\\n"})
        return
    out = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}]}).encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": out})
''', "starlette": '''
import json
from pydantic import BaseModel
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route
class Msg(BaseModel):
    role: str
    content: str
class Req(BaseModel):
    model: str
    messages: list[Msg]
    max_tokens: int = 16
    stream: bool = False
async def chat(request):
    req = Req.model_validate_json(await request.body())
    if req.stream:
        async def events():
            for i in range(req.max_tokens):
                data = json.dumps({"choices": [{"index": 0, "delta": {"content": "tok"}}]})
                yield f"data: {data}\\n\\n"
            yield "data: [DONE]\\n\\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    return JSONResponse({"choices": [{"index": 0, "message": {"role": "assistant", "content": "x"}}]})
app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
''', "fastapi": '''
import json
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
class Msg(BaseModel):
    role: str
    content: str
class Req(BaseModel):
    model: str
    messages: list[Msg]
    max_tokens: int = 16
    stream: bool = False
class Choice(BaseModel):
    index: int
    message: Msg
class Resp(BaseModel):
    choices: list[Choice]
app = FastAPI()
@app.post("/v1/chat/completions", response_model=Resp)
async def chat(req: Req):
    if req.stream:
        async def events():
            for i in range(req.max_tokens):
                data = json.dumps({"choices": [{"index": 0, "delta": {"content": "tok"}}]})
                yield f"data: {data}\\n\\n"
            yield "data: [DONE]\\n\\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    return Resp(choices=[Choice(index=0, message=Msg(role="assistant", content="x"))])
'''}


def serve(name: str, tmp: Path) -> tuple[subprocess.Popen, int]:
    (tmp / f"app_{name}.py").write_text(APPS[name])
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", f"app_{name}:app", "--port",
                             str(port), "--http", "httptools", "--loop", "asyncio",
                             "--log-level", "warning", "--no-access-log"], cwd=tmp)
    for _ in range(200):
        try:
            http.client.HTTPConnection("127.0.0.1", port, timeout=1).connect()
            return proc, port
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{name} did not start")


def measure(port: int, requests: int, tokens: int) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port)

    def call(stream: bool) -> float:
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                           "max_tokens": tokens, "stream": stream})
        t = time.perf_counter()
        conn.request("POST", "/v1/chat/completions", body,
                     {"content-type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        assert resp.status == 200
        return time.perf_counter() - t

    for _ in range(20):
        call(False), call(True)
    unary = [call(False) for _ in range(requests)]
    streams = [call(True) for _ in range(max(20, requests // 10))]
    conn.close()
    p50 = statistics.median(unary)
    return {"request_p50_ms": p50 * 1e3,
            "request_p99_ms": sorted(unary)[int(len(unary) * 0.99) - 1] * 1e3,
            "per_token_us": (statistics.median(streams) - p50) / tokens * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--tokens", type=int, default=200)
    a = ap.parse_args()
    import tempfile
    runs: dict[str, list[dict]] = {n: [] for n in APPS}
    with tempfile.TemporaryDirectory() as d:
        servers = {n: serve(n, Path(d)) for n in APPS}
        try:
            for _ in range(a.runs):
                for n, (_, port) in servers.items():
                    runs[n].append(measure(port, a.requests, a.tokens))
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.wait()
    flags = next((line.split(":", 1)[1].split() for line in
                  Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), [])
    result = {"date": datetime.now(timezone.utc).isoformat(), "machine": platform.machine(),
              "cpu_flags": flags, "runs": a.runs, "requests": a.requests, "tokens": a.tokens,
              "median": {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
                         for n, rs in runs.items()}}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "asgi_stack.json").write_text(json.dumps(result, indent=2))
    for n, m in result["median"].items():
        print(f"{n:10s} request p50 {m['request_p50_ms']:.3f} ms  p99 {m['request_p99_ms']:.3f}"
              f" ms  per token {m['per_token_us']:.1f} us")


if __name__ == "__main__":
    main()

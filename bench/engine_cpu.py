"""Single-stream CPU speed of tokenserve's ModelRunner vs transformers, in the same run.

    python bench/engine_cpu.py [--runs 3] [--decode 64] [--threads 2] [--skip-hf] [--llama-bench PATH]

Same GGUF (SmolLM2-135M-Instruct Q4_1), same prompt token ids for every peer, EOS ignored.
Per run and configuration:
  - TTFT for a 128- and a 1,000-token prompt: ours = the prefill step that samples the first
    token; transformers = generate(max_new_tokens=1).
  - decode tok/s after the 128-token prompt: ours = `--decode` one-token steps;
    transformers = (generate(1 + decode, min_new_tokens) - TTFT) / decode.
Configurations: `default` (the service's defaults: the GGUF file's own blocks, in bfloat16
arithmetic where the CPU has AVX512-BF16, float16 KV), `blocks-float32` (the same blocks in
float32 arithmetic), `float32` (--exact), `int8`, `bfloat16`. No speculative decoding here:
one token per step.
Medians over runs, configurations interleaved inside each run; against llama.cpp also each
run's own ratio and their median (a drift of the machine between runs moves both). Quality of the faster
settings: greedy agreement with float32 (--exact), teacher-forced (each position's argmax given
the float32 prefix) over 64 tokens of three prompts.
llama.cpp in-process: its llama-bench binary with --llama-bench (same Q4_1 file and threads),
else llama-cpp-python if importable (see shared/BENCH.md).
--isa avx2 measures as on a CPU without AVX-512 (bench/machine.py run_capped; give
--llama-bench the one `bench/build_llama_server.sh DIR avx2` builds).
Writes bench/results/engine_cpu.json and bench/results/engine_cpu.png (engine_cpu_<isa>.*
under --isa; --out STEM writes STEM.json and STEM.png instead).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

import torch  # noqa: E402

from services.engine.interface import Batch, SamplingParams, SeqChunk  # noqa: E402
from bench.machine import add_isa_arg, machine_facts, run_capped  # noqa: E402
from services.engine.runner import ModelRunner  # noqa: E402
from tokenserve.models import default_model_path  # noqa: E402
from tokenserve.tokenization import load_model_tokenizer  # noqa: E402

RESULTS = ROOT / "bench" / "results"
TEXT = ("The history of computing is a story of abstraction layered on abstraction: relays gave "
        "way to vacuum tubes, tubes to transistors, transistors to integrated circuits. Each step "
        "made machines smaller and faster, and each new language let programmers say more with "
        "less. Today a phone holds more power than the rooms of machines that sent people to the "
        "Moon, and models trained on text can write, summarise and translate. ")


def prompt_ids(tok, n: int) -> list[int]:
    ids: list[int] = []
    i = 0
    while len(ids) < n:
        ids += tok.encode(f"Chapter {i}. " + TEXT)
        i += 1
    return ids[:n]


class Ours:
    def __init__(self, name: str, runner: ModelRunner):
        self.name, self.r = name, runner
        self.seq = 0

    def _table(self, n: int) -> list[int]:
        return list(range(-(-n // self.r.block_size)))

    def ttft(self, prompt: list[int]) -> float:
        self.seq += 1
        t0 = time.perf_counter()
        self.r.execute(Batch([SeqChunk(self.seq, prompt, 0, self._table(len(prompt)), True, SamplingParams())]))
        dt = time.perf_counter() - t0
        self.r.execute(Batch([], finished_seq_ids=[self.seq]))
        return dt

    def greedy(self, prompt: list[int], n: int, forced: list[int] | None = None) -> list[int]:
        """n greedy tokens; with `forced`, feed forced[i] instead of our own choice (teacher forcing)."""
        self.seq += 1
        table = self._table(len(prompt) + n)
        g = SamplingParams()
        out = [self.r.execute(Batch([SeqChunk(self.seq, prompt, 0, table, True, g)])).sampled[self.seq].token_id]
        for i in range(n - 1):
            feed = forced[i] if forced else out[-1]
            r = self.r.execute(Batch([SeqChunk(self.seq, [feed], len(prompt) + i, table, True, g)]))
            out.append(r.sampled[self.seq].token_id)
        self.r.execute(Batch([], finished_seq_ids=[self.seq]))
        return out

    def decode_rate(self, prompt: list[int], n: int) -> float:
        self.seq += 1
        table = self._table(len(prompt) + n + 1)
        g = SamplingParams()
        tok = self.r.execute(Batch([SeqChunk(self.seq, prompt, 0, table, True, g)])).sampled[self.seq].token_id
        t0 = time.perf_counter()
        for i in range(n):
            tok = self.r.execute(Batch([SeqChunk(self.seq, [tok], len(prompt) + i, table, True, g)])).sampled[self.seq].token_id
        dt = time.perf_counter() - t0
        self.r.execute(Batch([], finished_seq_ids=[self.seq]))
        return n / dt


class HF:
    def __init__(self, name: str, model):
        self.name, self.m = name, model

    def _gen(self, prompt: list[int], n: int) -> float:
        ids = torch.tensor([prompt])
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, top_p=None, top_k=None, temperature=None, pad_token_id=2)
        return time.perf_counter() - t0

    def ttft(self, prompt: list[int]) -> float:
        return self._gen(prompt, 1)

    def decode_rate(self, prompt: list[int], n: int) -> float:
        first = self._gen(prompt, 1)
        return n / max(1e-9, self._gen(prompt, n + 1) - first)


class LlamaCpp:
    """llama.cpp in-process through llama-cpp-python, run in a child process (a build with
    AMX kernels crashes at the first decode on these CPUs; that must not end the benchmark)."""

    name = "llama.cpp Q4_1"

    def __init__(self, threads: int):
        self.threads = threads

    def measure(self, p128: list[int], p1000: list[int], n: int) -> dict[str, float] | None:
        arg = json.dumps({"p128": p128, "p1000": p1000, "n": n, "threads": self.threads})
        proc = subprocess.run([sys.executable, __file__, "--llama-cpp-child"], input=arg, text=True,
                              capture_output=True, timeout=900)
        if proc.returncode != 0:
            print(f"llama.cpp child failed (rc {proc.returncode}): {proc.stderr[-300:]}", flush=True)
            return None
        return json.loads(proc.stdout.strip().splitlines()[-1])


class LlamaBench:
    """llama.cpp in-process through its own llama-bench binary (`--llama-bench PATH`, built from
    the same source tree as bench/build_llama_server.sh's server): prompt processing of 128
    and 1,000 tokens (the TTFTs) and 64 generated tokens after a 128-token context (`-d`)."""

    name = LlamaCpp.name

    def __init__(self, binary: str, threads: int):
        self.binary, self.threads = binary, threads

    def measure(self, p128: list[int], p1000: list[int], n: int) -> dict[str, float] | None:
        cmd = [self.binary, "-m", str(default_model_path()), "-t", str(self.threads), "-r", "1",
               "-o", "json", "-p", "128,1000", "-n", "0"]
        gen = [self.binary, "-m", str(default_model_path()), "-t", str(self.threads), "-r", "1",
               "-o", "json", "-p", "0", "-n", str(n), "-d", str(len(p128))]
        out = {}
        try:
            for rec in json.loads(subprocess.run(cmd, capture_output=True, text=True, timeout=900,
                                                 check=True).stdout):
                out[f"ttft_{rec['n_prompt']}_s"] = rec["avg_ns"] / 1e9
            rec = json.loads(subprocess.run(gen, capture_output=True, text=True, timeout=900,
                                            check=True).stdout)[0]
            out["decode_tok_s"] = rec["avg_ts"]
        except (subprocess.SubprocessError, OSError, ValueError, KeyError, IndexError) as e:
            print(f"llama-bench failed: {type(e).__name__}: {e}"[:300], flush=True)
            return None
        return out


def llama_cpp_child() -> None:
    import numpy as np
    from llama_cpp import Llama

    a = json.loads(sys.stdin.read())
    llm = Llama(model_path=str(default_model_path()), n_ctx=2048, n_batch=1024, n_threads=a["threads"],
                n_threads_batch=a["threads"], verbose=False)

    def prefill(ids):
        llm.reset()  # no prefix reuse between measurements
        t0 = time.perf_counter()
        llm.eval(ids)
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        return time.perf_counter() - t0, tok

    prefill(a["p128"][:16])  # warm-up
    out = {"ttft_128_s": prefill(a["p128"])[0], "ttft_1000_s": prefill(a["p1000"])[0]}
    _, tok = prefill(a["p128"])
    t0 = time.perf_counter()
    for _ in range(a["n"]):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    out["decode_tok_s"] = a["n"] / (time.perf_counter() - t0)
    print(json.dumps(out))


def agreement(ref: Ours, other: Ours, prompts: list[list[int]], n: int = 64) -> float:
    same = total = 0
    for p in prompts:
        gold = ref.greedy(p, n)
        got = other.greedy(p, n, forced=gold)
        same += sum(a == b for a, b in zip(gold, got))
        total += n
    return same / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--llama-bench", default=None,
                    help="path of llama.cpp's llama-bench (built beside bench/build_llama_server.sh's"
                         " server): llama.cpp in-process as a peer")
    ap.add_argument("--configs", default="default,blocks-float32,float32,int8,bfloat16")
    ap.add_argument("--out", default=None,
                    help="path stem of the .json and .png (default bench/results/engine_cpu[_ISA])")
    ap.add_argument("--llama-cpp-child", action="store_true", help=argparse.SUPPRESS)
    add_isa_arg(ap)
    args = ap.parse_args()
    if args.llama_cpp_child:
        return llama_cpp_child()
    run_capped(args.isa)
    out = Path(args.out) if args.out else RESULTS / ("engine_cpu" + ("" if args.isa == "auto" else f"_{args.isa}"))
    torch.set_num_threads(args.threads)
    path = default_model_path()
    tok = load_model_tokenizer(path)
    p128, p1000 = prompt_ids(tok, 128), prompt_ids(tok, 1000)
    load_avg_start = os.getloadavg()
    facts = machine_facts(path)

    peers: list = []
    settings = {"default": ("float32", "auto", "auto"), "blocks-float32": ("float32", "auto", "float32"),
                "float32": ("float32", "none", "auto"), "int8": ("float32", "int8", "auto"),
                "bfloat16": ("bfloat16", "none", "auto")}
    for cfg in args.configs.split(","):
        dtype, quant, decode = settings[cfg]
        r = ModelRunner(path, dtype=dtype, quantization=quant, num_blocks=160, num_threads=args.threads,
                        decode_dtype=decode)
        peers.append(Ours(f"tokenserve {cfg}", r))
        print(f"loaded tokenserve {cfg} in {r.load_seconds:.1f}s", flush=True)
    if not args.skip_hf:
        import transformers
        m = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
        peers.append(HF("transformers float32", m))
        import copy
        peers.append(HF("transformers bfloat16", copy.deepcopy(m).to(torch.bfloat16)))
    llama = LlamaBench(args.llama_bench, args.threads) if args.llama_bench else None
    if llama is None:
        try:
            import llama_cpp  # noqa: F401
            llama = LlamaCpp(args.threads)
        except ImportError:
            print("llama.cpp: neither --llama-bench nor llama-cpp-python; skipped (see shared/BENCH.md)",
                  flush=True)

    names = [p.name for p in peers] + ([llama.name] if llama else [])
    samples: dict[str, dict[str, list[float]]] = {n: {"ttft_128_s": [], "ttft_1000_s": [], "decode_tok_s": []}
                                                 for n in names}
    for p in peers:  # warm-up: first calls allocate and fault in pages
        p.ttft(p128[:16])
    for run in range(args.runs):
        for p in peers:
            s = samples[p.name]
            s["ttft_128_s"].append(p.ttft(p128))
            s["ttft_1000_s"].append(p.ttft(p1000))
            s["decode_tok_s"].append(p.decode_rate(p128, args.decode))
            print(f"run {run} {p.name}: ttft128 {s['ttft_128_s'][-1]:.3f}s ttft1000 {s['ttft_1000_s'][-1]:.3f}s "
                  f"decode {s['decode_tok_s'][-1]:.1f} tok/s", flush=True)
        got = llama.measure(p128, p1000, args.decode) if llama else None
        if got:
            for k, v in got.items():
                samples[llama.name][k].append(v)
            print(f"run {run} {llama.name}: {got}", flush=True)
    samples = {n: s for n, s in samples.items() if s["decode_tok_s"]}

    medians = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()}
    ours = {p.name: p for p in peers if isinstance(p, Ours)}
    quality = {}
    if "tokenserve float32" in ours:
        qp = [p128, prompt_ids(tok, 40)[::-1], tok.encode_chat([{"role": "user", "content": "Name three rivers."}])]
        for name, p in ours.items():
            if name != "tokenserve float32":
                quality[name] = agreement(ours["tokenserve float32"], p, qp)
    llama_decode = medians.get(LlamaCpp.name, {}).get("decode_tok_s")
    hf_best = max((m["decode_tok_s"] for n, m in medians.items() if n.startswith("transformers")), default=None)
    ratios = {}
    if hf_best:
        hf32 = medians.get("transformers float32", {})
        for n, m in medians.items():
            if n.startswith("tokenserve"):
                ratios[n] = {"decode_vs_best_transformers": m["decode_tok_s"] / hf_best,
                             # without a same-run llama.cpp figure: BENCH.md's 94 tok/s (2 threads, idle machine)
                             ("decode_vs_llama_cpp" if llama_decode else "decode_vs_benchmd_llama_cpp_94"):
                                 m["decode_tok_s"] / (llama_decode or 94.0),
                             "ttft_128_vs_transformers_f32": m["ttft_128_s"] / hf32.get("ttft_128_s", float("nan")),
                             "ttft_1000_vs_transformers_f32": m["ttft_1000_s"] / hf32.get("ttft_1000_s", float("nan"))}
                if llama_decode:
                    # each run measures both within a minute: a drift of the machine between
                    # runs moves both, so the per-run ratio is the steadier figure
                    per_run = [a / b for a, b in zip(samples[n]["decode_tok_s"],
                                                     samples[LlamaCpp.name]["decode_tok_s"])]
                    ratios[n]["decode_vs_llama_cpp_per_run"] = per_run
                    ratios[n]["decode_vs_llama_cpp_per_run_median"] = statistics.median(per_run)
    result = {
        "benchmark": "engine_cpu single stream", "model": path.name,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "threads": args.threads, **facts,
                    "load_avg_start": load_avg_start, "load_avg_end": os.getloadavg(),
                    "note": "shared 2-core machine; other engineers' jobs were running"},
        "block_arithmetic": {p.name: p.r.block_arithmetic for p in peers
                             if isinstance(p, Ours) and p.r.quantization == "auto"},
        "runs": args.runs, "decode_tokens": args.decode, "medians": medians, "samples": samples,
        "ratios": ratios, "greedy_agreement_vs_float32": quality,
        "roofline_fraction_one_stream": {n: round(m["decode_tok_s"] / facts["roofline_tok_s_one_stream"], 3)
                                         for n, m in medians.items()},
        "llama_cpp": (("measured in this run: llama-bench, in-process (tg after a 128-token context)"
                       if isinstance(llama, LlamaBench) else
                       "measured in this run (llama-cpp-python, in-process, argmax on its logits)")
                      if llama_decode else "not measured; ratios use BENCH.md's 94 tok/s"),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_name(out.name + ".json").write_text(json.dumps(result, indent=2))
    plot(medians, out.with_name(out.name + ".png"), args.threads)
    print(json.dumps({"medians": medians, "ratios": ratios, "quality": quality}, indent=2))


def plot(medians: dict, out: Path, threads: int) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(medians)
    colors = ["tab:blue" if n.startswith("tokenserve") else "tab:orange" if n.startswith("llama") else "tab:gray"
              for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, key, title in zip(axes, ["decode_tok_s", "ttft_128_s", "ttft_1000_s"],
                              ["decode tok/s (higher is better)", "TTFT 128 tokens, s", "TTFT 1000 tokens, s"]):
        vals = [medians[n][key] for n in names]
        ax.barh(names, vals, color=colors)
        for i, v in enumerate(vals):
            ax.text(v, i, f" {v:.2f}" if v < 10 else f" {v:.0f}", va="center")
        ax.set_title(title)
    fig.suptitle(f"SmolLM2-135M Q4_1 GGUF, single stream, {threads} thread(s), shared CPU (medians)")
    fig.tight_layout()
    fig.savefig(out, dpi=100)


if __name__ == "__main__":
    main()

"""Which kernel should multiply the engine's weights on this CPU? Maintained ones vs our own C.

Times every linear layer of one SmolLM2-135M decode step (30 layers' fused QKV, O, gate/up
and down, plus the tied output head; the real weights of the bundled Q4_1 GGUF, so the step
reads as many distinct bytes as the engine does) at batch 1, 16 and 64 rows, for:

  float32        F.linear over the float32-dequantized weights (the exact mode)
  bfloat16       F.linear in bfloat16 (oneDNN; AVX-512-BF16/AMX where present)
  int8 (own C)   cpu_kernels.int8_linear, per-channel int8 (the engine's int8 mode)
  int8pack       torch._weight_int8pack_mm (the op torchao's int8 weight-only CPU path uses)
  int4pack       torch._weight_int4pack_mm_for_cpu, group 32 (torchao's Int4CPULayout), bf16
  inductor int8  torch.compile of dequantize-then-matmul over int8 weights
  gguf (own C)   gguf_kernels.linear over the file's own Q4_1 / Q8_0 blocks in float32
                 arithmetic; where the CPU has AVX512-BF16 also in bfloat16 dot products, and
                 the interleaved kernel (gguf_kernels.linear_interleaved, the default there)

Medians of several repeats, all in one process; writes bench/results/linear_kernels.json
(with the CPU flags) and a PNG.
    flock /tmp/tokenserve-bench.lock .venv/bin/python bench/linear_kernels.py [--repeats 7]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from services.engine import cpu_kernels, gguf_kernels  # noqa: E402
from services.engine.loader import load_weights  # noqa: E402
from tokenserve.models import default_model_path  # noqa: E402

RESULTS = ROOT / "bench" / "results"


def layer_weights(path: Path) -> tuple[list[torch.Tensor], list[gguf_kernels.GGUFWeight]]:
    """The float32 matrices and the file's blocks of every linear of one forward, in order."""
    loaded = load_weights(path, keep_blocks=True)
    c, q = loaded.config, loaded.quantized
    names = []
    for i in range(c.num_layers):
        p = f"layers.{i}."
        names += [[p + "wq", p + "wk", p + "wv"], [p + "wo"], [p + "w_gate", p + "w_up"], [p + "w_down"]]
    names.append(["lm_head" if "lm_head" in q else "embed"])
    blocks = [gguf_kernels.GGUFWeight.cat([q[n] for n in group]) for group in names]
    return [b.dequantize() for b in blocks], blocks


def int8_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous(), scale.contiguous()


def int4_pack(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit, one scale/zero per group of 32 (the layout torchao's Int4CPULayout feeds
    torch's kernel): w ~= (q - 8) * scale + zero."""
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
    zero = lo + 8 * scale
    packed = torch._convert_weight_to_int4pack_for_cpu(q, 1)
    sz = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return packed, sz


def step_time(fns: list, x: dict[int, torch.Tensor], repeats: int) -> float:
    """Median seconds of one pass over every linear; x: the input rows by input width."""
    for f in fns:  # warm-up
        f(x)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for f in fns:
            f(x)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rows", default="1,16,64")
    ap.add_argument("--out", type=Path, default=RESULTS / "linear_kernels.json")
    a = ap.parse_args()
    rows = [int(r) for r in a.rows.split(",")]
    torch.manual_seed(0)
    dense, blocks = layer_weights(default_model_path())
    width = {w.shape[1] for w in dense}
    xs32 = {r: {k: torch.randn(r, k) for k in width} for r in rows}

    def per_width(make):
        """make(weight_index) -> fn(x_by_width) list, one per linear."""
        return [make(i) for i in range(len(dense))]

    candidates: dict[str, list] = {}
    candidates["float32"] = per_width(lambda i: (lambda xs, w=dense[i]: F.linear(xs[w.shape[1]], w)))
    bf = [w.to(torch.bfloat16) for w in dense]
    candidates["bfloat16"] = per_width(
        lambda i: (lambda xs, w=bf[i]: F.linear(xs[w.shape[1]].to(torch.bfloat16), w).float()))
    lib = cpu_kernels.load()
    int8 = [int8_quantize(w) for w in dense]
    if lib is not None:
        packed = [cpu_kernels.pack_int8(q, s) for q, s in int8]
        candidates["int8 (own C)"] = per_width(
            lambda i: (lambda xs, p=packed[i], n=dense[i].shape[0], k=dense[i].shape[1]:
                       cpu_kernels.int8_linear(lib, xs[k], p[0], p[1], n)))
    candidates["int8pack (torch)"] = per_width(
        lambda i: (lambda xs, q=int8[i][0], s=int8[i][1]: torch._weight_int8pack_mm(xs[q.shape[1]], q, s)))
    int4 = [int4_pack(w) for w in dense]
    candidates["int4pack bf16 (torch)"] = per_width(
        lambda i: (lambda xs, p=int4[i], k=dense[i].shape[1]:
                   torch._weight_int4pack_mm_for_cpu(xs[k].to(torch.bfloat16), p[0], 32, p[1]).float()))

    @torch.compile(dynamic=False)
    def dq_mm(x, q, s):
        return F.linear(x, q.float() * s[:, None])

    candidates["inductor int8"] = per_width(
        lambda i: (lambda xs, q=int8[i][0], s=int8[i][1]: dq_mm(xs[q.shape[1]], q, s)))
    glib = gguf_kernels.load()
    if glib is not None:
        candidates[f"gguf blocks (own C, {glib.gguf_isa().decode()})"] = per_width(
            lambda i: (lambda xs, b=blocks[i]: gguf_kernels.linear(glib, xs[b.shape[1]], b)))
    if gguf_kernels.has_bfloat16(glib):
        candidates["gguf blocks, bfloat16 dot products (own C)"] = per_width(
            lambda i: (lambda xs, b=blocks[i]: gguf_kernels.linear(glib, xs[b.shape[1]], b, bf16=True)))
    il = gguf_kernels.load_interleaved()
    if il is not None:  # the default on this CPU, where every matrix interleaves
        packed = [gguf_kernels.pack_interleaved(il, b) for b in blocks]
        if all(p is not None for p in packed):
            candidates["gguf blocks interleaved, bfloat16 (own C, the default)"] = per_width(
                lambda i: (lambda xs, b=blocks[i], p=packed[i]:
                           gguf_kernels.linear_interleaved(il, xs[b.shape[1]], p, b)))
    avx2 = gguf_kernels.load("avx2") if "avx2" in gguf_kernels.runnable_isas() else None
    if avx2 is not None and avx2 is not glib:
        candidates["gguf blocks (own C, avx2)"] = per_width(
            lambda i: (lambda xs, b=blocks[i]: gguf_kernels.linear(avx2, xs[b.shape[1]], b)))

    bytes_read = {
        "float32": sum(w.numel() * 4 for w in dense),
        "gguf": sum(b.blocks.numel() for b in blocks),
        "int8": sum(w.numel() for w in dense),
    }
    results: dict[str, dict[str, float]] = {}
    with torch.inference_mode():
        for name, fns in candidates.items():
            results[name] = {}
            for r in rows:
                try:
                    t = step_time(fns, xs32[r], a.repeats)
                except Exception as e:  # noqa: BLE001 - a kernel this CPU/torch lacks: say so
                    print(f"{name} rows={r}: {type(e).__name__}: {e}"[:200])
                    continue
                results[name][str(r)] = t
                print(f"{name:34s} rows={r:3d}  {t * 1e3:8.2f} ms/step", flush=True)
    out = {
        "what": "all linear layers of one SmolLM2-135M forward (30 layers + tied head), seconds per step, median",
        "repeats": a.repeats, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "cpu_flags": sorted(cpu_kernels.cpu_flags()), "weight_bytes": bytes_read,
        "seconds": results,
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4))
        for ax, r in zip(axes, rows):
            names = [n for n in results if str(r) in results[n]]
            ax.barh(names, [results[n][str(r)] * 1e3 for n in names])
            ax.set_title(f"{r} row(s): ms per forward's linears")
        fig.tight_layout()
        fig.savefig(a.out.with_suffix(".png"))
    except ImportError:
        pass
    print(a.out)


if __name__ == "__main__":
    main()

"""Greedy agreement of the engine's default weights with the float32-dequantized reference.

    python bench/engine_agreement.py [--new-tokens 64]

On the oracle prompts of tests/integration/engine_model (plain, chat, code, multilingual,
list, a 1,000-token prompt prefilled in 256-token chunks), 64 greedy tokens from:
  exact             --exact: float32 weights dequantized from the file, float32 KV cache
  default           the service's defaults: the file's own blocks (decode rows in bfloat16
                    arithmetic where the CPU has AVX512-BF16, else with their input in 16-bit
                    fixed point; prompt chunks of 32+ rows in bfloat16 where it multiplies
                    bfloat16 natively), float16 KV cache
  blocks_float32    the file's own blocks in float32 arithmetic, float32 KV cache (summation
                    order the only difference)
  prefill_int8      the defaults but --prefill-dtype int8 (prompt rows' input rounded to int8
                    per block of 32, as llama.cpp rounds its activations; opt-in)
For each mode and prompt: the first position where its tokens leave the exact path, the
exact model's top-2 logit gap there (a near-tie means rounding chose), and the share of
the 64 tokens equal position by position. Then, finer than whether greedy tokens flip: the
logits a prompt's prefill gives (at the end of each prompt and of it plus 16 / 32 / 48
tokens of the exact continuation; KV cache float32 in every mode, so only the multiplies
differ) against the exact model's: KL(exact || mode) and the largest |logit difference|.
Writes bench/results/engine_agreement.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.machine import machine_facts  # noqa: E402
from services.engine.runner import ModelRunner  # noqa: E402
from tests.integration.engine_model import oracle  # noqa: E402
from tests.integration.engine_model.test_smollm_oracle import prompts  # noqa: E402
from tokenserve.models import default_model_path  # noqa: E402
from tokenserve.tokenization import load_model_tokenizer  # noqa: E402

MODES = {"exact": dict(quantization="none", dtype="float32", kv_cache_dtype="float32"),
         "default": dict(quantization="auto"),
         "blocks_float32": dict(quantization="auto", kv_cache_dtype="float32", prefill_dtype="float32",
                                decode_dtype="float32"),
         "prefill_int8": dict(quantization="auto", prefill_dtype="int8")}
CUTS = (0, 16, 32, 48)  # continuation tokens after each prompt where prefill logits are compared


def prefill_logits_error(runner: ModelRunner, inputs: list[list[int]], ref: list[torch.Tensor]) -> dict:
    """KL(exact || runner) and max |logit difference| at the last position of each input,
    summarized over the inputs (mean / median / max), and how many keep the exact argmax."""
    kls, worst, top1 = [], [], 0
    for x, lr in zip(inputs, ref):
        lg = oracle.runner_last_logits(runner, x).double()
        p, q = torch.log_softmax(lr, -1), torch.log_softmax(lg, -1)
        kls.append((p.exp() * (p - q)).sum().item())
        worst.append((lg - lr).abs().max().item())
        top1 += int(lg.argmax() == lr.argmax())
    return {"kl_mean": statistics.mean(kls), "kl_median": statistics.median(kls), "kl_max": max(kls),
            "max_abs_logit_diff_median": statistics.median(worst), "max_abs_logit_diff_max": max(worst),
            "same_argmax": top1, "of": len(inputs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "engine_agreement.json")
    a = ap.parse_args()
    path = default_model_path()
    cases = prompts(load_model_tokenizer(path))
    tokens: dict[str, dict[str, list[int]]] = {}
    runners, arithmetic, logit_error = {}, {}, {}
    inputs: list[list[int]] = []
    ref: list[torch.Tensor] = []
    for mode, kw in MODES.items():
        runners[mode] = r = ModelRunner(path, num_blocks=160, **kw)
        if kw.get("quantization") == "auto":
            arithmetic[mode] = r.block_arithmetic
        tokens[mode] = {name: oracle.runner_greedy(r, p, a.new_tokens, prefill_chunk=256 if len(p) > 500 else 10_000)
                        for name, p in cases.items()}
        if mode == "exact":
            inputs = [p + tokens[mode][name][:k] for name, p in cases.items() for k in CUTS]
            ref = [oracle.runner_last_logits(r, x).double() for x in inputs]
        else:
            del runners[mode]
            f32_kv = ModelRunner(path, num_blocks=160, **{**kw, "kv_cache_dtype": "float32"})
            logit_error[mode] = prefill_logits_error(f32_kv, inputs, ref)
            print(mode, "prefill logits", logit_error[mode], flush=True)
            del f32_kv
    exact = runners["exact"]
    report: dict[str, dict] = {}
    for mode in MODES:
        if mode == "exact":
            continue
        per = {}
        for name, p in cases.items():
            ref, got = tokens["exact"][name], tokens[mode][name]
            first = next((i for i, (x, y) in enumerate(zip(ref, got)) if x != y), None)
            entry = {"same_tokens": sum(x == y for x, y in zip(ref, got)) / len(ref), "first_divergence": first}
            if first is not None:
                top = oracle.runner_last_logits(exact, p + ref[:first]).topk(2)
                entry["exact_top2_gap_there"] = round((top.values[0] - top.values[1]).item(), 5)
                entry["its_token_is_exact_second_best"] = got[first] == top.indices[1].item()
            per[name] = entry
            print(mode, name, entry, flush=True)
        report[mode] = {"prompts": per,
                        "identical_prompts": sum(e["first_divergence"] is None for e in per.values()),
                        "of": len(per)}
    out = {"benchmark": "engine_agreement", "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "model": path.name, "new_tokens": a.new_tokens, "modes": {k: v for k, v in MODES.items()},
           "block_arithmetic": arithmetic,
           "machine": machine_facts(),
           "vs_exact": report,
           "prefill_logits_vs_exact": {"continuation_cuts": CUTS, "kv_cache_dtype": "float32", **logit_error}}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2))
    print(a.out)


if __name__ == "__main__":
    main()

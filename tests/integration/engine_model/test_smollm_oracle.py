"""SmolLM2-135M-Instruct (the shipped Q4_1 GGUF): our runner against transformers loading the
same file in float32. Greedy decoding must match token for token."""
from __future__ import annotations

import pytest
import torch

from services.engine.runner import ModelRunner
from tests.integration.engine_model import oracle
from tokenserve.models import default_model_path
from tokenserve.tokenization import load_model_tokenizer

pytestmark = pytest.mark.slow

N_NEW = 64
# logit gap under which summation order alone may pick either token (float32 rounding through
# 30 layers moves these logits by ~1e-4)
NEAR_TIE = 1e-2
# the same for bfloat16 arithmetic (its one parting on the oracle prompts: a 0.026 gap)
BFLOAT16_NEAR_TIE = 0.1
PARAGRAPHS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based inks and a wooden press adapted from wine making.",
    "Photosynthesis converts light energy into chemical energy: chlorophyll absorbs photons, water "
    "is split, oxygen is released, and carbon dioxide is fixed into sugars by the Calvin cycle.",
    "In distributed systems, consensus protocols such as Raft elect a leader, replicate a log to "
    "followers and commit entries once a majority has stored them, tolerating minority failures.",
    "A good sourdough needs a lively starter, a long cold fermentation, careful shaping and a very "
    "hot oven with steam during the first twenty minutes so that the crust can expand.",
    "The Pacific Ocean covers about a third of the Earth's surface; its trenches reach depths of "
    "nearly eleven kilometres, and its ring of fire hosts most of the world's active volcanoes.",
    "Compilers translate source code through lexing, parsing, semantic analysis, optimisation "
    "passes over an intermediate representation, register allocation and finally code emission.",
]


@pytest.fixture(scope="module")
def tok():
    return load_model_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(default_model_path(), num_blocks=160, quantization="none", dtype="float32")  # --exact


@pytest.fixture(scope="module")
def hf_model():
    transformers = pytest.importorskip("transformers")
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


def prompts(tok) -> dict[str, list[int]]:
    long_ids: list[int] = []
    i = 0
    while len(long_ids) < 1000:
        long_ids += tok.encode(PARAGRAPHS[i % len(PARAGRAPHS)] + f" (section {i})\n")
        i += 1
    chat = tok.encode_chat([{"role": "system", "content": "You are a concise assistant."},
                            {"role": "user", "content": "Give me three tips for writing clear code."}])
    return {
        "plain": tok.encode("The capital of France is"),
        "chat": chat,
        "code": tok.encode("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
        "multilingual": tok.encode("Traduis en français : « The weather is nice today. » Réponse :"),
        "list": tok.encode("Here is a list of the planets in the solar system:\n1."),
        "long_1000": long_ids[:1000],
    }


@pytest.fixture(scope="module")
def cases(tok):
    return prompts(tok)


@pytest.mark.parametrize("name", ["plain", "chat", "code", "multilingual", "list", "long_1000"])
def test_greedy_64_tokens_match_transformers(runner, hf_model, cases, name):
    prompt = cases[name]
    # The long prompt is prefilled in chunks, as the scheduler does under a token budget.
    ours = oracle.runner_greedy(runner, prompt, N_NEW, prefill_chunk=256 if len(prompt) > 500 else 10_000,
                                stop_ids=runner.eos_token_ids)
    assert len(ours) == N_NEW or ours[-1] in runner.eos_token_ids
    # Teacher-forced transformers: one pass gives its greedy choice after every prefix.
    assert oracle.hf_argmax_along(hf_model, prompt, ours) == ours


def test_transformers_generate_agrees_on_the_chat_prompt(runner, hf_model, cases):
    """One real transformers generate() call, as a check on the teacher-forced comparison."""
    prompt = cases["chat"]
    ours = oracle.runner_greedy(runner, prompt, 24, stop_ids=runner.eos_token_ids)
    assert oracle.hf_greedy(hf_model, prompt, 24) == ours


@pytest.mark.parametrize("name", ["plain", "chat", "long_1000"])
def test_last_position_logits_agree(runner, hf_model, cases, name):
    prompt = cases[name]
    ours = oracle.runner_last_logits(runner, prompt)
    theirs = oracle.hf_last_logits(hf_model, prompt)
    assert ours.argmax().item() == theirs.argmax().item()
    assert torch.allclose(ours, theirs, atol=2e-3, rtol=0), (ours - theirs).abs().max().item()


def test_runner_reports_the_gguf_metadata(runner):
    assert runner.model_name == "Smollm2 135M 8k Lc100K Mix1 Ep2"
    assert runner.vocab_size == 49152 and runner.eos_token_ids == (2,)
    assert runner.max_context == 160 * 16


@pytest.fixture(scope="module")
def blocks_runner() -> ModelRunner:
    """The file's own Q4_1/Q8_0 blocks, multiplied in registers in float32 arithmetic, with a
    float32 KV cache: the summation order is the only difference from `runner`."""
    return ModelRunner(default_model_path(), num_blocks=160, quantization="auto", kv_cache_dtype="float32",
                       prefill_dtype="float32", decode_dtype="float32")


@pytest.fixture(scope="module")
def default_runner() -> ModelRunner:
    """The service's defaults: the file's blocks, in bfloat16 arithmetic where the CPU has
    AVX512-BF16, and a float16 KV cache."""
    return ModelRunner(default_model_path(), num_blocks=160, quantization="auto")


def parts_only_at_near_ties(runner, prompt, exact, fast, tie):
    """The greedy paths may part only where the exact model's two best tokens are within `tie`."""
    i = next((i for i, (a, b) in enumerate(zip(fast, exact)) if a != b), None)
    if i is not None:
        top = oracle.runner_last_logits(runner, prompt + exact[:i]).topk(2)
        assert fast[i] in top.indices.tolist(), i
        assert (top.values[0] - top.values[1]).item() < tie, (i, top.values.tolist())


@pytest.mark.parametrize("name", ["chat", "code"])  # all six agree: bench/engine_agreement.py
def test_the_files_blocks_follow_the_exact_greedy_path(runner, blocks_runner, cases, name):
    """Same numbers as the float32-dequantized model, summed in another order."""
    prompt = cases[name]
    parts_only_at_near_ties(runner, prompt, oracle.runner_greedy(runner, prompt, N_NEW),
                            oracle.runner_greedy(blocks_runner, prompt, N_NEW), NEAR_TIE)


@pytest.mark.parametrize("name", ["chat", "code", "long_1000"])
def test_the_defaults_follow_the_exact_greedy_path(runner, default_runner, cases, name):
    """bfloat16 arithmetic (where the CPU has it) and a float16 KV cache round more than the
    summation order does, so near-ties are wider (bench/engine_agreement.py: where they part)."""
    prompt = cases[name]
    chunk = 256 if len(prompt) > 500 else 10_000
    parts_only_at_near_ties(runner, prompt, oracle.runner_greedy(runner, prompt, N_NEW, prefill_chunk=chunk),
                            oracle.runner_greedy(default_runner, prompt, N_NEW, prefill_chunk=chunk),
                            BFLOAT16_NEAR_TIE)


@pytest.mark.parametrize("name", ["chat", "long_1000"])
def test_a_bfloat16_prompt_step_gives_the_same_logits_with_bfloat16_activations(default_runner, cases, name):
    """A prompt step multiplied in bfloat16 passes bfloat16 between its multiplies (the norms
    and the MLP activation round as the multiply would): bit-identical to float32 copies."""
    model, prompt = default_runner.model, (cases[name] * 16)[:200]  # a step of 200 prompt rows
    if not model._bf16_step(len(prompt), len(prompt)):
        pytest.skip("this CPU multiplies prompt steps in float32 (no native bfloat16)")
    through = oracle.runner_last_logits(default_runner, prompt)
    model.bf16_activations = False
    try:
        between = oracle.runner_last_logits(default_runner, prompt)
    finally:
        model.bf16_activations = True
    assert torch.equal(through, between)


CODE = "\n".join(
    ["def process_orders(records, limit=100):", '    """Filter and total the order records."""',
     "    total = 0", "    kept = []"]
    + [f"    if records[{i}].value > limit:\n        kept.append(records[{i}])\n"
       f"        total += records[{i}].value" for i in range(6)]
    + ["    return kept, total"])


def code_edit_prompts(tok) -> dict[str, list[int]]:
    ask = lambda text: tok.encode_chat([{"role": "user", "content": text}])
    return {
        "edit_rename": ask("Rewrite this function with `limit` renamed to `threshold`. Output only"
                           f" the code.\n\n```python\n{CODE}\n```"),
        "edit_docstring": ask(f"```python\n{CODE}\n```\nRepeat the function above exactly, with"
                              " a better docstring."),
    }


def test_speculative_greedy_output_equals_plain_greedy(runner, cases, tok):
    """Oracle and code-edit prompts together, drafts on and off: the same tokens, and the
    code edits accept many drafts."""
    from services.engine.block_manager import BlockManager
    from services.engine.engine_core import EngineCore
    from services.engine.interface import SamplingParams
    from services.engine.scheduler import Scheduler, SchedulerConfig
    from services.engine.sequence import Sequence, StopCriteria
    from services.engine.speculation import SpeculationConfig

    prompts = {**cases, **code_edit_prompts(tok)}  # all six oracle prompts, long_1000 included

    def run(spec: bool, first_id: int):
        sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_model_len=runner.max_context,
                                          speculation=SpeculationConfig(enabled=spec)),
                          BlockManager(runner.num_blocks, runner.block_size), set(runner.eos_token_ids))
        core = EngineCore(runner, sched)
        seqs = {name: Sequence(first_id + i, name, p, SamplingParams(), StopCriteria(max_tokens=N_NEW))
                for i, (name, p) in enumerate(prompts.items())}
        for s in seqs.values():
            core.add(s)
        while core.has_work():
            core.step()
        return seqs

    plain, fast = run(False, 100), run(True, 200)
    for name in prompts:
        assert fast[name].output_token_ids == plain[name].output_token_ids, name
    for name in code_edit_prompts(tok):
        d = fast[name].drafter
        assert d.accepted >= N_NEW // 4, (name, d.proposed, d.accepted)



def test_greedy_output_with_history_drafts_equals_plain_greedy(default_runner, tok):
    """Tool calls of one tenant (bench/speculative.py's workload) on the default weights: the
    later answers draft from the earlier ones, and every output equals speculation off."""
    from bench.speculative import tool_call
    from services.engine.block_manager import BlockManager
    from services.engine.engine_core import EngineCore
    from services.engine.interface import SamplingParams
    from services.engine.scheduler import Scheduler, SchedulerConfig
    from services.engine.sequence import Sequence, StopCriteria
    from services.engine.speculation import SpeculationConfig

    prompts = [tok.encode_chat(tool_call(seed)) for seed in range(4)]
    runner = default_runner

    def run(spec: bool, first_id: int):
        sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_model_len=runner.max_context,
                                          speculation=SpeculationConfig(enabled=spec)),
                          BlockManager(runner.num_blocks, runner.block_size), set(runner.eos_token_ids))
        core = EngineCore(runner, sched)
        seqs = []
        for i, p in enumerate(prompts):  # one at a time: each finds the answers before it
            seqs.append(Sequence(first_id + i, str(i), p, SamplingParams(),
                                 StopCriteria(max_tokens=N_NEW), tenant_id="a"))
            core.add(seqs[-1])
            while core.has_work():
                core.step()
        return seqs

    plain, fast = run(False, 300), run(True, 400)
    for a, b in zip(plain, fast):
        assert b.output_token_ids == a.output_token_ids, a.request_id
    assert fast[0].drafter.history_proposed == 0
    counts = [(s.drafter.history_proposed, s.drafter.history_accepted) for s in fast]
    assert sum(a for _, a in counts[1:]) >= N_NEW // 2, counts


# The defaults on a CPU with fewer instruction sets than this one: TOKENSERVE_CPU_ISA caps the
# kernels (and torch, as `python -m services.engine` does) in a fresh process, which reports the
# paths it took and its greedy tokens.
CAPPED_RUN = r"""
import json, sys
from services.engine import isa
isa.apply_to_torch()
import torch
from services.engine import cpu_kernels, gguf_kernels
from services.engine.runner import ModelRunner
from tests.integration.engine_model import oracle
from tokenserve.models import default_model_path
prompts, n = json.loads(sys.argv[1]), int(sys.argv[2])
runner = ModelRunner(default_model_path(), num_blocks=160, quantization="auto")
lib = gguf_kernels.load()
paths = {"torch": torch.backends.cpu.get_cpu_capability(), "gguf": lib.gguf_isa().decode() if lib else None,
         "interleaved": gguf_kernels.load_interleaved() is not None, "fused": cpu_kernels.load() is not None,
         "c_layers": bool(runner.model._c_linears)}
print(json.dumps({"paths": paths, "greedy": {k: oracle.runner_greedy(runner, p, n) for k, p in prompts.items()}}))
"""


def capped_greedy(level: str, prompts: dict[str, list[int]]) -> dict:
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {**os.environ, "TOKENSERVE_CPU_ISA": level}
    for name in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"):
        env.pop(name, None)
    done = subprocess.run([sys.executable, "-c", CAPPED_RUN, json.dumps(prompts), str(N_NEW)], env=env,
                          cwd=Path(__file__).resolve().parents[3], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_avx2_only_cpu_gets_the_avx2_kernels_and_follows_the_exact_greedy_path(runner, cases):
    """What a CPU without AVX-512 runs by default: the blocks' AVX2 build in float32
    arithmetic, the C decode layers, torch at AVX2, a float16 KV cache."""
    from services.engine import isa

    if not {"avx2", "fma", "f16c"} <= isa.hardware_flags():
        pytest.skip("this CPU lacks AVX2/FMA/F16C")
    prompts = {name: cases[name] for name in ("chat", "code")}
    got = capped_greedy("avx2", prompts)
    assert got["paths"] == {"torch": "AVX2", "gguf": "avx2", "interleaved": False, "fused": True,
                            "c_layers": True}
    for name, prompt in prompts.items():
        parts_only_at_near_ties(runner, prompt, oracle.runner_greedy(runner, prompt, N_NEW),
                                got["greedy"][name], BFLOAT16_NEAR_TIE)


def test_a_cpu_without_avx2_is_served_by_torch_and_follows_the_exact_greedy_path(runner, cases):
    """No AVX at all: no C kernel is built; the file's blocks are dequantized once and torch
    multiplies them."""
    prompts = {name: cases[name] for name in ("chat", "code")}
    got = capped_greedy("none", prompts)
    assert got["paths"] == {"torch": "DEFAULT", "gguf": None, "interleaved": False, "fused": False,
                            "c_layers": False}
    for name, prompt in prompts.items():
        parts_only_at_near_ties(runner, prompt, oracle.runner_greedy(runner, prompt, N_NEW),
                                got["greedy"][name], BFLOAT16_NEAR_TIE)

"""The overlapped step order (the CUDA default) on the real SmolLM2 runner, run on the CPU:
streamed text, finish reasons and billed tokens equal the plain order's, with stop strings,
speculative drafts and a cancel in flight; every KV block comes back."""
from __future__ import annotations

import pytest

from services.engine.block_manager import BlockManager
from services.engine.engine_core import EngineCore, text_stream_factory
from services.engine.interface import SamplingParams
from services.engine.runner import ModelRunner
from services.engine.scheduler import Scheduler, SchedulerConfig
from services.engine.sequence import FinishReason, Sequence, StopCriteria
from services.engine.speculation import SpeculationConfig
from tokenserve.models import default_model_path
from tokenserve.tokenization import load_model_tokenizer

pytestmark = pytest.mark.slow

N_NEW = 32
CODE = "def area(w, h):\n    return w * h\n\n\ndef perimeter(w, h):\n    return 2 * (w + h)\n"


@pytest.fixture(scope="module")
def tok():
    return load_model_tokenizer(default_model_path())


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return ModelRunner(default_model_path(), num_blocks=96, quantization="none", dtype="float32")


def chats(tok) -> dict[str, list[int]]:
    ask = lambda text: tok.encode_chat([{"role": "user", "content": text}])
    return {"capital": ask("What is the capital of France? Answer in two sentences."),
            "edit": ask(f"Repeat this code exactly:\n```python\n{CODE}```"),
            "list": ask("Name five colours, one per line.")}


def run(runner, tok, prompts, *, overlap, stops, cancel_after=None):
    """Streams every prompt; with overlap, in EngineLoop's overlapped order. Returns
    {name: (text, finish reason, billed completion tokens)}."""
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_model_len=runner.max_context,
                                      speculation=SpeculationConfig(enabled=True)),
                      BlockManager(runner.num_blocks, runner.block_size), set(runner.eos_token_ids))
    core = EngineCore(runner, sched, text_stream=text_stream_factory(tok), overlap=overlap)
    names = {}
    for i, (name, ids) in enumerate(prompts.items()):
        names[i] = name
        core.add(Sequence(i, name, ids, SamplingParams(),
                          StopCriteria(max_tokens=N_NEW, stop=stops.get(name, ()))))
    outs = []
    cancel = dict(cancel_after or {})
    while core.has_work() or core.has_outputs():
        launched = core.launch() if core.has_work() else None
        if not overlap and launched is not None:
            core.complete(launched)
            launched = None
        outs += core.take_outputs()
        for sid, name in names.items():  # a cancel once the stream has that many tokens
            got = sum(len(o.token_ids) for o in outs if o.seq_id == sid)
            if name in cancel and got >= cancel[name]:
                del cancel[name]
                if (o := core.abort(sid)) is not None:
                    outs.append(o)
        if launched is not None:
            core.complete(launched)
    assert core.scheduler.blocks.num_free_blocks == runner.num_blocks
    result = {}
    for sid, name in names.items():
        [final] = [o for o in outs if o.seq_id == sid and o.final is not None]
        text = "".join(o.text for o in outs if o.seq_id == sid)
        tokens = sum(len(o.token_ids) for o in outs if o.seq_id == sid)
        assert final.final.completion_tokens == tokens  # billed = streamed
        result[name] = (text, final.finish_reason, tokens)
    return result


def test_overlapped_order_streams_what_the_plain_order_streams(runner, tok):
    prompts = chats(tok)
    free = run(runner, tok, prompts, overlap=False, stops={})
    # a stop string from the middle of each answer, so generation ends on it
    stops = {name: (text[len(text) // 2:len(text) // 2 + 4],) for name, (text, _, _) in free.items()}
    plain = run(runner, tok, prompts, overlap=False, stops=stops, cancel_after={"list": 5})
    overlapped = run(runner, tok, prompts, overlap=True, stops=stops, cancel_after={"list": 5})
    assert overlapped == plain
    assert plain["capital"][1] is FinishReason.STOP and plain["edit"][1] is FinishReason.STOP
    assert plain["list"][1] is FinishReason.CANCELLED

"""Prompt token ids for the pipeline: in this process where the gateway can read the model's
tokenizer artifact, else through the tokenizer service.

Why in-process: admission needs a request's prompt token count before any engine work, and
a round trip to the tokenizer service was the largest single part of what the gateway added
to a request. The ids come from the one tokenizer implementation (tokenserve.tokenization)
that the tokenizer service and the engine use, loaded from the same artifact (the model's
default version in etcd, as the tokenizer service resolves it), so they are the same ids.

A model whose artifact this host cannot read (a gateway on another host than the model
files), or whose tokenizer is still loading, goes to the tokenizer service, as does every
model with `local=False` (`--tokenize remote`). A load runs once per artifact, in the
background, when the model appears in the config.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import Executor, Future
from pathlib import Path
from typing import Sequence

import structlog

from controlplane.snapshot import ConfigSnapshot
from services.gateway.downstream import TokenizerClient
from services.gateway.validation import InferenceRequest
from tokenserve.models import artifact_path
from tokenserve.tokenization import ModelTokenizer, load_model_tokenizer

# Lazy: resolved at first use, after configure_logging (JSON lines).
log = structlog.get_logger(component="tokenizers")

# Up to this many characters a prompt is encoded on the event loop itself (tens of
# microseconds); longer ones on a worker thread, so one long prompt never stalls the streams
# the loop is relaying.
INLINE_CHARS = 4096


class Tokenizers:
    """`encode` / `count` / `token_texts` as TokenizerClient has them, in-process when it can."""

    def __init__(self, remote: TokenizerClient, executor: Executor, *, local: bool = True):
        self.remote = remote
        self._executor = executor
        self._local = local
        self._paths: dict[str, Path] = {}  # model -> its artifact, readable here
        self._loaded: dict[str, tuple[Path, ModelTokenizer]] = {}
        self._loading: dict[str, tuple[Path, Future]] = {}

    def apply(self, snapshot: ConfigSnapshot) -> None:
        """Sync callback for ConfigWatcher.on_change (and the first snapshot): follows the
        models' default-version artifacts; starts loading each new one in the background."""
        if not self._local:
            return
        paths: dict[str, Path] = {}
        for name, spec in snapshot.models.items():
            version = spec.versions.get(spec.default_version)
            try:
                path = artifact_path(version.artifact) if version is not None else None
            except FileNotFoundError:  # a builtin model whose wheel this host lacks
                path = None
            if path is not None and path.exists():
                paths[name] = path
        self._paths = paths
        for name in list(self._loaded):
            if self._paths.get(name) != self._loaded[name][0]:
                del self._loaded[name]
        for name, path in paths.items():
            if name in self._loaded or self._loading.get(name, (None,))[0] == path:
                continue
            future = self._executor.submit(load_model_tokenizer, path)
            self._loading[name] = (path, future)
            future.add_done_callback(lambda f, n=name, p=path: self._done(n, p, f))

    def _done(self, name: str, path: Path, future: Future) -> None:
        # On the executor's thread: dict assignments only (atomic under the GIL).
        if self._loading.get(name, (None,))[0] == path:
            del self._loading[name]
        if future.cancelled():
            return
        exc = future.exception()
        if exc is not None:
            log.warning("local_tokenizer_unavailable", model=name, path=str(path),
                        error=str(exc), detail="encoding through the tokenizer service")
            return
        if self._paths.get(name) == path:
            self._loaded[name] = (path, future.result())
            log.info("local_tokenizer_loaded", model=name, path=str(path))

    def local(self, model: str) -> ModelTokenizer | None:
        """The in-process tokenizer of `model`, if loaded from its current artifact."""
        loaded = self._loaded.get(model)
        return loaded[1] if loaded is not None and loaded[0] == self._paths.get(model) else None

    async def encode(self, model: str, req: InferenceRequest, timeout: float) -> list[int]:
        tok = self.local(model)
        if tok is None:
            return await self.remote.encode(model, req, timeout)
        size = len(req.prompt) if req.messages is None else sum(len(m.content) for m in req.messages)
        if size <= INLINE_CHARS:
            return _encode(tok, req)
        return await asyncio.get_running_loop().run_in_executor(self._executor, _encode, tok, req)

    async def count(self, model: str, req: InferenceRequest, timeout: float) -> int:
        if self.local(model) is None:
            return await self.remote.count(model, req, timeout)
        return len(await self.encode(model, req, timeout))

    async def token_texts(self, model: str, token_ids: Sequence[int],
                          timeout: float) -> dict[int, str]:
        """Each id's own text (for logprobs), special tokens included."""
        tok = self.local(model)
        if tok is None:
            return await self.remote.token_texts(model, token_ids, timeout)
        return {i: tok.decode([i], skip_special_tokens=False) for i in token_ids}


def _encode(tok: ModelTokenizer, req: InferenceRequest) -> list[int]:
    """What the tokenizer service's Encode gives for the request TokenizerClient sends."""
    if req.messages is not None:
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        return tok.encode_chat_rendered(messages, add_generation_prompt=True)[0]
    return tok.encode(req.prompt, add_special_tokens=True)

"""Model name -> tokenizer, each loaded from its artifact on first use and then cached."""
from __future__ import annotations

import asyncio
from collections.abc import Mapping
from concurrent.futures import Executor
from pathlib import Path

import structlog

from tokenserve.runtime.errors import InvalidArgument, NotFound
from tokenserve.tokenization import ModelTokenizer, load_model_tokenizer

# A lazy proxy: picks up configure_logging() even though it is created at import.
log = structlog.get_logger(component="tokenizer_registry")


class TokenizerRegistry:
    """Concurrent first requests for one model share a single load; a failed load is not
    cached (the artifact may be fixed), and its error (FAILED_PRECONDITION) reaches the caller."""

    def __init__(self, models: Mapping[str, Path], executor: Executor):
        self._paths: dict[str, Path] = {name: Path(p) for name, p in models.items()}
        self._loaded: dict[str, tuple[Path, ModelTokenizer]] = {}
        self._loading: dict[str, tuple[Path, asyncio.Task]] = {}
        self._executor = executor

    def names(self) -> list[str]:
        return sorted(self._paths)

    def set_path(self, name: str, path: Path) -> None:
        """Adds a model, or points it at a new artifact (the old tokenizer is dropped)."""
        self._paths[name] = Path(path)

    def remove(self, name: str) -> None:
        self._paths.pop(name, None)
        self._loaded.pop(name, None)

    def _cached(self, name: str) -> ModelTokenizer | None:
        """The loaded tokenizer of `name` if it is from the current artifact; raises for an
        unknown or empty name."""
        path = self._path(name)
        cached = self._loaded.get(name)
        return cached[1] if cached is not None and cached[0] == path else None

    def get_blocking(self, name: str, loop: asyncio.AbstractEventLoop) -> ModelTokenizer:
        """`get` from a thread other than the event loop's: a loaded tokenizer comes straight
        from the cache; a first load runs (shared) on `loop` and this thread waits for it."""
        cached = self._cached(name)
        if cached is not None:
            return cached
        return asyncio.run_coroutine_threadsafe(self.get(name), loop).result()

    async def get(self, name: str) -> ModelTokenizer:
        cached = self._cached(name)
        if cached is not None:
            return cached
        path = self._path(name)
        pending = self._loading.get(name)
        if pending is None or pending[0] != path:
            pending = (path, asyncio.ensure_future(self._load(name, path)))
            self._loading[name] = pending
        # shield: one caller's cancellation must not cancel the load the others wait for.
        return await asyncio.shield(pending[1])

    async def _load(self, name: str, path: Path) -> ModelTokenizer:
        loop = asyncio.get_running_loop()
        try:
            tok = await loop.run_in_executor(self._executor, load_model_tokenizer, path)
        except Exception as exc:
            log.error("tokenizer_load_failed", model=name, path=str(path), error=str(exc))
            raise
        finally:
            if self._loading.get(name, (None, None))[1] is asyncio.current_task():
                del self._loading[name]
        if self._paths.get(name) == path:
            self._loaded[name] = (path, tok)
        log.info("tokenizer_loaded", model=name, path=str(path), vocab_size=tok.vocab_size)
        return tok

    def _path(self, name: str) -> Path:
        if not name:
            raise InvalidArgument(f"model is required; known models: {', '.join(self.names())}")
        path = self._paths.get(name)
        if path is None:
            raise NotFound(f"unknown model {name!r}; known models: {', '.join(self.names())}")
        return path

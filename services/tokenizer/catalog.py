"""Models from etcd (`/tokenserve/v1/models/<name>`) kept in step with the registry.

A model's tokenizer comes from its default version's artifact (tokenserve.models.artifact_path).
Models given on the command line win over etcd documents of the same name.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import structlog

from controlplane.schema import ModelSpec
from controlplane.snapshot import ConfigSnapshot
from services.tokenizer.registry import TokenizerRegistry
from tokenserve.models import artifact_path

# A lazy proxy: picks up configure_logging() even though it is created at import.
log = structlog.get_logger(component="tokenizer_catalog")


class EtcdModels:
    def __init__(self, registry: TokenizerRegistry, pinned: Mapping[str, Path]):
        self._registry = registry
        self._pinned = set(pinned)
        self._from_etcd: dict[str, Path] = {}

    def apply(self, snapshot: ConfigSnapshot) -> None:
        """Sync callback for ConfigWatcher.on_change (and the first snapshot)."""
        wanted: dict[str, Path] = {}
        for name, spec in snapshot.models.items():
            if name in self._pinned:
                continue
            path = self._path(spec)
            if path is not None:
                wanted[name] = path
        for name in set(self._from_etcd) - set(wanted):
            self._registry.remove(name)
            log.info("model_removed", model=name)
        for name, path in wanted.items():
            if self._from_etcd.get(name) != path:
                self._registry.set_path(name, path)
                log.info("model_added", model=name, path=str(path))
        self._from_etcd = wanted

    @staticmethod
    def _path(spec: ModelSpec) -> Path | None:
        artifact = spec.versions[spec.default_version].artifact
        path = artifact_path(artifact)
        if path is None:
            log.warning("model_artifact_unknown", model=spec.name, artifact=artifact)
        return path

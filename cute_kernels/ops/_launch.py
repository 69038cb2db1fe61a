"""Per-op launch cache and tuning overrides shared by the torch ops.

An op keys its prepared launches (compiled kernel, argument order, workspace views) by a tuple
of cheap tensor attributes, so repeated calls skip validation and selection. Benchmarks and tests
compare kernel variants with ``tuning_override``; the active override is part of every key.
"""

from __future__ import annotations


class LaunchCache:
    def __init__(self, max_entries: int = 4096):
        self.entries: dict[tuple, object] = {}
        self.max_entries = max_entries
        self.override: dict = {}
        self.override_key: tuple = ()

    def get(self, key):
        return self.entries.get(key)

    def put(self, key, launch) -> None:
        if len(self.entries) >= self.max_entries:  # shapes churn: start over rather than grow forever
            self.entries.clear()
        self.entries[key] = launch

    def tuning_override(self, **fields: object) -> TuningOverride:
        return TuningOverride(self, fields)


class TuningOverride:
    """Context manager: ``fields`` override the op's tuning while active (nests)."""

    def __init__(self, cache: LaunchCache, fields: dict) -> None:
        self.cache, self.fields = cache, fields

    def __enter__(self):
        self.saved = dict(self.cache.override)
        self._set({**self.saved, **self.fields})
        return self

    def __exit__(self, *exc):
        self._set(self.saved)
        return False

    def _set(self, fields: dict) -> None:
        self.cache.override = fields
        self.cache.override_key = tuple(sorted(fields.items()))

"""The one exception type of the dispatch layer.

``UnsupportedConfig`` subclasses ``ValueError`` so callers that already catch bad arguments keep
working, while the CLI and the attention layer can tell "this configuration has no kernel" apart
from programming errors. Every message names the argument (or kernel constraint) at fault and
what was expected: vLLM's dispatch bugs (anchors-features.md §3) were hard to diagnose because
the failure surfaced deep inside a kernel JIT instead of at the decision point.
"""

from __future__ import annotations


class UnsupportedConfig(ValueError):
    """A request (arch, phase, dtypes, shape, explicit backend) that no kernel can serve."""

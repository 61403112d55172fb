"""What a training step keeps for its backward.

Three layers can either save what their backward needs or recompute it there: the cpu backend's
attention probabilities (imggen.attention.blocked), the normalised LayerNorm output that a Linear reads and the
MLP's hidden activations (imggen.fused). Recomputing keeps memory lean (attention O(N * D) instead of
O(N * keys per row)); saving is faster where memory is not the limit. Each layer call saves when the
tensors it would keep are at most `save_limit()` bytes (`IMGGEN_SAVE_MB`, default 64 MiB; 0 =
always recompute, the leanest), so small problems (the demo preset) save and large ones (cifar,
brats, long sequences) recompute.
"""
from __future__ import annotations

import os

from imggen.errors import ConfigError

DEFAULT_SAVE_MB = 64.0


def save_limit() -> int:
    """Bytes a layer call may save instead of recomputing in its backward."""
    raw = os.environ.get("IMGGEN_SAVE_MB", "").strip()
    if not raw:
        return int(DEFAULT_SAVE_MB * 2**20)
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not mb >= 0 or mb == float("inf"):
        raise ConfigError(f"IMGGEN_SAVE_MB must be a number of MiB >= 0 (0 = always recompute), got {raw!r}")
    return int(mb * 2**20)


def saves(nbytes: int) -> bool:
    """Whether a layer call that would keep `nbytes` for its backward should save them."""
    return nbytes <= save_limit()

"""imggen: autoregressive image generation with causal sparse attention.

The public API (DESIGN.md) is resolved lazily so that `import imggen.datasets` or
`import imggen.eval` does not pull in the model code.
"""
import importlib

# The function shadows its module's name on the package, so bind it eagerly.
from imggen.sparse_attention import sparse_attention  # noqa: E402,F401

_API = {
    "make_pattern": "imggen.patterns",
    "load_model": "imggen.checkpoint",
    "teacher_force": "imggen.sampling",
    "sample": "imggen.sampling",
    "detokenize": "imggen.sampling",
    "inpaint": "imggen.sampling",
    "generate": "imggen.sampling",
}

__all__ = ["sparse_attention", *_API]


def __getattr__(name):
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'imggen' has no attribute {name!r}")

"""imggen: autoregressive image generation with causal sparse attention.

The public API is resolved lazily so that `import imggen.datasets` or
`import imggen.eval` does not pull in the model code.
"""
import importlib

_API = {
    "sparse_attention": "imggen.attention",
    "make_pattern": "imggen.patterns",
    "load_model": "imggen.checkpoint",
    "teacher_force": "imggen.sampling",
    "sample": "imggen.sampling",
    "detokenize": "imggen.sampling",
    "inpaint": "imggen.sampling",
    "generate": "imggen.sampling",
}

__all__ = list(_API)


def __getattr__(name):
    if name in _API:
        return getattr(importlib.import_module(_API[name]), name)
    raise AttributeError(f"module 'imggen' has no attribute {name!r}")

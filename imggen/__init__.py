"""imggen: autoregressive image generation with causal sparse attention."""
from imggen.patterns import make_pattern  # noqa: F401

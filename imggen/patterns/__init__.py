"""Causal attention patterns over raster-order token sequences.

Each pattern is one class, the single home of its knowledge (see `base.Pattern` for the
questions every pattern answers and their generic answers). Adding a pattern is one subclass
that defines `rule`; it registers itself under its `name` for `make_pattern` and the configs.
"""
from __future__ import annotations

import dataclasses

from imggen.errors import ConfigError

from .base import PATTERNS, BandShape, BlockPlan, KernelLayout, KernelRule, KernelSpec, Pattern, Ranges, RasterShape
from .local2d import Local2D
from .random import BigBird, Diffuser
from .simple import Band, Column, Full, Strided

__all__ = ["PATTERNS", "BandShape", "BlockPlan", "KernelLayout", "KernelRule", "KernelSpec", "Pattern", "Ranges",
           "RasterShape", "Full", "Band", "Local2D", "BigBird", "Diffuser", "Strided", "Column", "make_pattern",
           "config_params", "pattern_for_image"]


def make_pattern(kind: str, **params) -> Pattern:
    """Build a pattern by name: full, band, local2d, bigbird, diffuser, strided, column. Every
    parameter's type and range is checked up front (`base.check_params`): a ConfigError naming it."""
    if not isinstance(kind, str) or kind not in PATTERNS:
        raise ConfigError(f"unknown attention pattern {kind!r}; choose one of {', '.join(PATTERNS)}")
    cls = PATTERNS[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(params) - names)
    if bad:
        raise ConfigError(f"pattern {kind!r} takes no parameter(s) {bad}; it takes {sorted(names - {'layer'})}")
    return cls(**params)


def config_params() -> dict[str, dict]:
    """Every configurable pattern parameter, once: config name -> {type, default, help, fields}
    where fields maps pattern kind -> its dataclass field. Parameters whose default depends on the
    image (`auto`) default to None = "the pattern's default for this image size"."""
    out: dict[str, dict] = {}
    for kind, cls in PATTERNS.items():
        for f in dataclasses.fields(cls):
            if f.metadata.get("geometry") or "help" not in f.metadata:
                continue
            name = f.metadata.get("config") or f.name
            entry = out.setdefault(name, {"type": {"int": int, "float": float}[str(f.type)],
                                          "default": None if f.metadata["auto"] else f.default,
                                          "help": f.metadata["help"], "fields": {}})
            entry["fields"][kind] = f.name
    return out


def pattern_for_image(kind: str, height: int, width: int, channels: int, values: dict) -> Pattern:
    """The pattern `kind` for an image size, from config values (name -> value, None = default)."""
    if not isinstance(kind, str) or kind not in PATTERNS:
        raise ConfigError(f"unknown attention pattern {kind!r}; choose one of {', '.join(PATTERNS)}")
    cls = PATTERNS[kind]
    params = cls.image_defaults(height, width, channels)
    for name, entry in config_params().items():
        field = entry["fields"].get(kind)
        if field is not None and values.get(name) is not None:
            params[field] = values[name]
    return cls(**params)

"""Configuration: dataclasses, named presets, and the per-layer attention patterns they imply."""
from __future__ import annotations

import dataclasses
import json
import math
import typing
from dataclasses import dataclass, field
from typing import ClassVar

from imggen.inpainting.context import CONTEXTS, FILLS, MAX_CONTEXT_SLICES
from imggen.inpainting.tasks import TASKS
from imggen.errors import ConfigError
from imggen.patterns import Pattern, config_params, pattern_for_image
from imggen.precision import PRECISIONS

BACKENDS = ("auto", "cpu", "triton", "flex", "reference")


def _at_least(section: str, obj, lo, open_: bool = False, **names) -> None:
    """ConfigError unless every named field is finite and > lo (open_) or >= lo; None passes."""
    for name in names:
        v = getattr(obj, name)
        if v is not None and not (math.isfinite(v) and (v > lo if open_ else v >= lo)):
            finite = "" if math.isfinite(v) else "a finite number "
            raise ConfigError(f"{section}.{name} must be {finite}{'>' if open_ else '>='} {lo}, got {v}")


def _at_most(section: str, obj, **limits) -> None:
    """ConfigError when a named field exceeds its limit. The limits are far above any model or run a
    machine can hold; they make a config file that names an absurd size (height 10**9) one clear
    error before anything is sized from it."""
    for name, hi in limits.items():
        v = getattr(obj, name)
        if v is not None and v > hi:
            raise ConfigError(f"{section}.{name} must be at most {hi}, got {v}")


@dataclass
class _ModelCore:
    height: int = 32
    width: int = 32
    channels: int = 1
    bits: int = 8
    dim: int = 128
    layers: int = 4
    heads: int = 4
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    mixture: int = 0                 # K > 0: a discretized logistic mixture of K components (imggen.mixture); 0: softmax
    # attention: one kind, or a comma-separated list cycled over layers ("local2d,band"); the
    # pattern parameters (window, radius, ...) are fields added from the pattern classes below
    attention: str = "band"
    backend: str = "auto"            # reference | cpu | triton | flex | auto
    context: str = "none"            # "unet": an inpainting model that sees the voided image (imggen.inpainting.context)
    context_width: int = 64          # channels of the context encoder
    context_slices: int = 0          # 2.5-D context: s neighbouring slices on each side (volume data, unet)
    context_fill: str = "none"       # "biharmonic"(3d): the context also carries the hole's classic fill (unet);
    #                                  "regress": a frozen hole regressor's fill (--train.regressor), carried by the model
    regress_width: int = 64          # context_fill regress: the regressor's settings (taken from its file)
    regress_hidden: int = 64
    regress_fill: str = "none"

    @property
    def seq_len(self) -> int:
        return self.height * self.width * self.channels

    @property
    def vocab(self) -> int:
        return 2 ** self.bits

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.channels, self.height, self.width)

    def validate(self) -> "ModelConfig":
        if self.channels not in (1, 3):
            raise ConfigError(f"model.channels must be 1 or 3, got {self.channels}")
        if not 1 <= self.bits <= 8:
            raise ConfigError(f"model.bits must be in 1..8, got {self.bits}")
        if self.dim % self.heads:
            raise ConfigError(f"model.dim ({self.dim}) must be divisible by model.heads ({self.heads})")
        _at_least("model", self, 1, height=1, width=1, layers=1, heads=1, dim=1)
        _at_most("model", self, height=8192, width=8192, layers=1024, heads=1024, dim=16384,
                 context_width=4096, mlp_ratio=64, regress_width=4096, regress_hidden=4096)
        if self.seq_len > 2 ** 24:
            raise ConfigError(f"model.height * width * channels must be at most {2 ** 24} tokens, got "
                              f"{self.height} * {self.width} * {self.channels} = {self.seq_len}")
        _at_least("model", self, 0, open_=True, mlp_ratio=0)
        _at_least("model", self, 0, mixture=0)
        _at_most("model", self, mixture=256)
        if self.mixture and self.bits < 2:
            raise ConfigError(f"model.mixture needs at least 2-bit tokens (bins of a line), got bits {self.bits}")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.context not in CONTEXTS:
            raise ConfigError(f"model.context must be one of {', '.join(CONTEXTS)}, got {self.context!r}")
        _at_least("model", self, 1, context_width=1)
        if not 0 <= self.context_slices <= MAX_CONTEXT_SLICES:
            raise ConfigError(f"model.context_slices must be in 0..{MAX_CONTEXT_SLICES}, got {self.context_slices}")
        if self.context_slices and self.context != "unet":
            raise ConfigError(f"model.context_slices {self.context_slices} (a 2.5-D context of neighbouring slices) "
                              f"needs model.context unet (--task inpaint), got {self.context!r}")
        if self.context_fill not in FILLS:
            raise ConfigError(f"model.context_fill must be one of {', '.join(FILLS)}, got {self.context_fill!r}")
        if self.context_fill != "none" and self.context != "unet":
            raise ConfigError(f"model.context_fill {self.context_fill!r} (a classic fill of the hole as context) needs "
                              f"model.context unet (--task inpaint), got {self.context!r}")
        if self.context_fill == "regress" and self.context_slices:
            raise ConfigError("model.context_fill regress (a regressor's fill of the hole) works on single images; "
                              f"it cannot be combined with model.context_slices {self.context_slices}")
        _at_least("model", self, 1, regress_width=1, regress_hidden=1)
        if self.regress_fill not in ("none", "biharmonic"):
            raise ConfigError(f"model.regress_fill (the regressor's own context) must be none or biharmonic, got "
                              f"{self.regress_fill!r}")
        if self.backend not in BACKENDS:
            raise ConfigError(f"model.backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        self.patterns()  # raises on bad pattern parameters
        return self

    def pattern_for(self, kind: str) -> Pattern:
        return pattern_for_image(kind, self.height, self.width, self.channels, dataclasses.asdict(self))

    def patterns(self) -> list[Pattern]:
        kinds = [k.strip() for k in self.attention.split(",")]
        if not any(kinds):
            raise ConfigError("model.attention is empty; use e.g. --attention band")
        if not all(kinds):
            raise ConfigError(f"--attention {self.attention!r} has an empty entry; list one pattern per layer "
                              f"(cycled), e.g. --attention local2d,band")
        return [self.pattern_for(kinds[i % len(kinds)]).for_layer(i) for i in range(self.layers)]

    def reset_pattern_params(self) -> None:
        """Every pattern parameter back to its default (a new --attention kind)."""
        for name, entry in PATTERN_PARAMS.items():
            setattr(self, name, entry["default"])


# Pattern parameters are declared once, in the pattern classes (imggen.patterns); each becomes an
# optional ModelConfig field (None = the pattern's default for the image size) and a train.py flag.
PATTERN_PARAMS = config_params()
ModelConfig = dataclasses.make_dataclass(
    "ModelConfig",
    [(name, e["type"] | None, field(default=e["default"], metadata={"help": e["help"]}))
     for name, e in PATTERN_PARAMS.items()],
    bases=(_ModelCore,), namespace={"__module__": __name__})


@dataclass
class TrainConfig:
    steps: int = 200
    batch_size: int = 16
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eval_every: int = 100
    eval_images: int = 64
    sample_every: int = 0           # 0: only at the end
    sample_num: int = 16
    grid_time_frac: float = 0.1     # end-of-run grid: at most this fraction of the training time (0: none)
    ckpt_every: int = 100
    log_every: int = 10
    seed: int = 0
    activation_checkpointing: bool = False  # recompute each block's activations in the backward
    task: str = "generate"          # generate | inpaint (a context model learns to fill masked pixels)
    augment: bool = False           # a random warp + gamma per training image (imggen.augment)
    precision: str = "auto"         # auto | fp32 | bf16: bf16 autocast of the forward (imggen.precision)
    ema: float = 0.0                # > 0: the run's model is this moving average of the weights (imggen.training.average)
    regressor: str = ""             # model.context_fill regress: the hole regressor (regress.pt) the model starts from

    def validate(self) -> "TrainConfig":
        _at_least("train", self, 1, steps=1, batch_size=1, eval_every=1, eval_images=1, sample_num=1,
                  ckpt_every=1, log_every=1)
        _at_least("train", self, 0, warmup=0, sample_every=0, weight_decay=0, seed=0, grid_time_frac=0)
        _at_least("train", self, 0, open_=True, lr=0, grad_clip=0)
        _at_most("train", self, steps=2 ** 40, batch_size=2 ** 16, eval_images=2 ** 20, sample_num=2 ** 12)
        if self.task not in TASKS:
            raise ConfigError(f"train.task must be one of {', '.join(TASKS)}, got {self.task!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"train.precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not 0 <= self.ema < 1:
            raise ConfigError(f"train.ema must be in [0, 1) (0: no weight average), got {self.ema}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        return self


@dataclass
class DataConfig:
    spec: str = "molecules"
    skip_bad: bool = False
    limit: int | None = None        # use at most this many images per split (quick runs)
    # how the data is read, not what it is (HOW_READ: a --resume may change them): worker processes
    # (0: the cores) and the on-disk cache folder ("": $IMGGEN_CACHE_DIR or ~/.cache/imggen) of
    # BraTS cases and molecule drawings
    workers: int = 0
    cache: str = ""
    HOW_READ: ClassVar[tuple[str, ...]] = ("workers", "cache")

    def validate(self) -> "DataConfig":
        _at_least("data", self, 1, limit=1)
        _at_least("data", self, 0, workers=0)
        return self


@dataclass
class Config:
    preset: str = "demo"
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def validate(self) -> "Config":
        self.model.validate()
        self.train.validate()
        self.data.validate()
        TASKS[self.train.task].check(self)
        if self.model.context_slices and self.data.spec.partition(":")[0] not in ("brats", "brats-demo"):
            raise ConfigError(f"model.context_slices {self.model.context_slices} (a 2.5-D context of neighbouring "
                              f"slices) needs volume data: --data brats:DIR or brats-demo, got {self.data.spec!r}")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        """The Config of a dict (a checkpoint's config.json); ConfigError when a section or field is
        missing, unknown or of the wrong type."""
        if not isinstance(d, dict) or "model" not in d:
            raise ConfigError("config is not an imggen config (a JSON object with a 'model' section); was it "
                              "written by another version?")
        preset = d.get("preset", "custom")
        if not isinstance(preset, str):
            raise ConfigError(f"config field preset must be a string, got {preset!r}")
        return cls(preset=preset, model=_section(ModelConfig, "model", d["model"]),
                   train=_section(TrainConfig, "train", d.get("train", {})),
                   data=_section(DataConfig, "data", d.get("data", {})))


def _fits(v, typ) -> bool:
    """Whether JSON value v can be a field of type typ (an int passes for a float, a bool for neither)."""
    if typing.get_args(typ):  # e.g. int | None
        return any(_fits(v, t) for t in typing.get_args(typ))
    if typ is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if typ is int:
        return isinstance(v, int) and not isinstance(v, bool)
    return isinstance(v, typ)


def _section(cls, name: str, d):
    if not isinstance(d, dict):
        raise ConfigError(f"config section {name} must be a mapping, got {type(d).__name__}")
    types = typing.get_type_hints(cls)
    for k, v in d.items():
        if k not in types:
            raise ConfigError(f"config section {name} has no field {k!r}; was it written by another version?")
        if not _fits(v, types[k]):
            raise ConfigError(f"config field {name}.{k} must be of type {getattr(types[k], '__name__', types[k])}, "
                              f"got {v!r}")
    return cls(**d)


PRESETS: dict[str, dict] = {
    # CPU demo: 32x32 molecule drawings, trains in a few minutes on 2 cores.
    "demo": dict(model=dict(height=32, width=32, channels=1, bits=8, dim=96, layers=4, heads=3,
                            attention="local2d,band", radius=3),
                 train=dict(steps=600, batch_size=16, lr=3e-3, warmup=30, eval_every=200, ckpt_every=200),
                 data=dict(spec="molecules")),
    "mol128": dict(model=dict(height=128, width=128, channels=1, bits=8, dim=256, layers=8, heads=8,
                              attention="band", window=512),
                   train=dict(steps=20000, batch_size=16, lr=1e-3, warmup=500, eval_every=1000,
                              ckpt_every=1000, sample_every=5000),
                   data=dict(spec="molecules")),
    "mol256": dict(model=dict(height=256, width=256, channels=1, bits=8, dim=256, layers=8, heads=8,
                              attention="local2d,band", window=1024),
                   train=dict(steps=20000, batch_size=8, lr=1e-3, warmup=500, eval_every=1000,
                              ckpt_every=1000, sample_every=5000),
                   data=dict(spec="molecules")),
    # full MOSES (--data moses, drawn lazily) at a size a shared 2-core CPU trains (a step of 8 images
    # ~3-7 s at 1 thread; at 128 px ~65 s). OSRA cannot judge 64 px drawings: MOSES-valid read-backs
    # of true drawings 0.05 at 64 px, 0.23 at 128, 0.62 at 192, 0.86 at 256 (100 a size, bench/RESULTS.md
    # section 11); the atom-level ceiling (sanitises, bond types) first passes 0.9 at 256 px: drawings
    # that read back need moses256, i.e. a GPU
    "moses": dict(model=dict(height=64, width=64, channels=1, bits=8, dim=64, layers=4, heads=2,
                             attention="local2d,band", radius=3, window=256),
                  train=dict(steps=5000, batch_size=8, lr=2e-3, warmup=100, eval_every=500, eval_images=16,
                             ckpt_every=500, sample_num=4),
                  data=dict(spec="moses")),
    # 256 px: OSRA reads atom labels (exact match 0.68, sanitises 0.94, bond types 0.96); for a GPU.
    # Decoding keeps only the band / local2d ring caches, so its memory does not grow with the 65,536-token sequence
    "moses256": dict(model=dict(height=256, width=256, channels=1, bits=8, dim=256, layers=8, heads=8,
                                attention="local2d,band", radius=4, window=1024),
                     train=dict(steps=50000, batch_size=8, lr=1e-3, warmup=500, eval_every=2000, eval_images=16,
                                ckpt_every=2000, sample_every=10000, sample_num=4),
                     data=dict(spec="moses")),
    "brats": dict(model=dict(height=64, width=64, channels=1, bits=8, dim=256, layers=8, heads=8,
                             attention="local2d,band", radius=4),
                  train=dict(steps=20000, batch_size=16, lr=1e-3, warmup=500, eval_every=1000,
                             ckpt_every=1000, sample_every=5000),
                  data=dict(spec="brats-demo")),
    # inpainting on the shipped brain slices: a context model small enough to train on a CPU
    "brats-inpaint": dict(model=dict(height=32, width=32, channels=1, bits=8, dim=128, layers=4, heads=4,
                                     attention="local2d,band", radius=3, context="unet", context_width=64),
                          train=dict(steps=2000, batch_size=16, lr=2e-3, warmup=100, eval_every=250, eval_images=64,
                                     ckpt_every=250, sample_num=8, task="inpaint"),
                          data=dict(spec="brats-demo")),
    # 64x64 inpainting (the brats-demo challenge-like masks): a context model still trainable on a CPU.
    # Its classic-fill context channel is the hole's 3-D biharmonic fill ("biharmonic3d": brats-demo's
    # 3-D fills in training, the volume's in sample.py --brats, which adds the model's correction to
    # that fill at native resolution, imggen.volumes); the warps of train.augment. Figures:
    # bench/RESULTS.md section 14 (native 240x240x155) and 10 (64x64, the 2-D fill channel, old split).
    "brats64": dict(model=dict(height=64, width=64, channels=1, bits=8, dim=128, layers=4, heads=4,
                               attention="local2d,band", radius=3, context="unet", context_width=64,
                               context_fill="biharmonic3d"),
                    train=dict(steps=3000, batch_size=8, lr=2e-3, warmup=100, eval_every=250, eval_images=32,
                               ckpt_every=250, sample_num=4, task="inpaint", augment=True),
                    data=dict(spec="brats-demo")),
    # Fashion-MNIST at its native 28x28 (--data fashion-mnist: Debian's dataset-fashion-mnist; test = the
    # official 10k): 57 min on 2 CPU cores (Intel Xeon) in bf16. The 15-minute lever rows chose width, lr and
    # the weight average (RESULTS 18, on val). Figures: bench/RESULTS.md sections 16 and 18
    "fashion": dict(model=dict(height=28, width=28, channels=1, bits=8, dim=160, layers=5, heads=4,
                               attention="local2d,band", radius=3),
                    train=dict(steps=6500, batch_size=16, lr=4e-3, warmup=100, eval_every=1000, eval_images=1000,
                               ckpt_every=500, sample_num=16, ema=0.999),
                    data=dict(spec="fashion-mnist")),
    # Fashion-MNIST inpainting: the earlier `fashion` model (dim 128 x 6) with a context encoder, trained on the random
    # masks. Figures: bench/RESULTS.md section 16 (bench/fashion_inpaint.py: big held-out holes)
    "fashion-inpaint": dict(model=dict(height=28, width=28, channels=1, bits=8, dim=128, layers=6, heads=4,
                                       attention="local2d,band", radius=3, context="unet", context_width=64),
                            train=dict(steps=5000, batch_size=16, lr=2e-3, warmup=100, eval_every=500,
                                       eval_images=500, ckpt_every=500, sample_num=16, task="inpaint"),
                            data=dict(spec="fashion-mnist")),
    "cifar": dict(model=dict(height=32, width=32, channels=3, bits=8, dim=256, layers=8, heads=8,
                             attention="local2d,band", radius=3),
                  train=dict(steps=100000, batch_size=32, lr=1e-3, warmup=1000, eval_every=2000,
                             ckpt_every=2000, sample_every=10000),
                  data=dict(spec="cifar:cifar-10-batches-py")),
}


def preset(name: str) -> Config:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    p = PRESETS[name]
    return Config(preset=name, model=ModelConfig(**p["model"]), train=TrainConfig(**p["train"]),
                  data=DataConfig(**p["data"]))


def _coerce(value: str, current, name: str):
    typ = type(current)
    try:
        if value.lower() in ("none", "null") and current is None:
            return None
        if isinstance(current, bool):
            if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return value.lower() in ("true", "1", "yes")
        if current is None:  # optional int fields
            return int(value)
        return typ(value)
    except ValueError:
        raise ConfigError(f"--{name}: cannot read {value!r} as {typ.__name__ if current is not None else 'int'}") from None


def apply_override(cfg: Config, dotted: str, value: str) -> None:
    """Set e.g. 'model.layers' = '8' on cfg, with type checking."""
    section, _, name = dotted.partition(".")
    if section not in ("model", "train", "data") or not name:
        raise ConfigError(f"--{dotted}: overrides look like --model.NAME, --train.NAME or --data.NAME")
    obj = getattr(cfg, section)
    if name not in {f.name for f in dataclasses.fields(obj)}:
        raise ConfigError(f"--{dotted}: {section} has no field {name!r}; fields: "
                          f"{', '.join(f.name for f in dataclasses.fields(obj))}")
    setattr(obj, name, _coerce(value, getattr(obj, name), dotted))

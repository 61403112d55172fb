"""Configuration: dataclasses, named presets, and the per-layer attention patterns they imply."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from imggen.errors import ConfigError
from imggen.patterns import Pattern, make_pattern


@dataclass
class ModelConfig:
    height: int = 32
    width: int = 32
    channels: int = 1
    bits: int = 8
    dim: int = 128
    layers: int = 4
    heads: int = 4
    mlp_ratio: float = 4.0
    dropout: float = 0.0
    # attention: one kind, or a comma-separated list cycled over layers ("local2d,band")
    attention: str = "band"
    window: int | None = None        # band / diffuser window (default: a few rows)
    radius: int = 3                  # local2d
    block: int | None = None         # bigbird / diffuser block (default: 32 below 64-token rows, else 64)
    window_blocks: int = 3           # bigbird
    global_blocks: int = 1           # bigbird
    random_blocks: int = 2           # bigbird
    global_tokens: int | None = None # diffuser (default: one row)
    random_edges: int = 8            # diffuser
    diffusion_steps: int = 5         # diffuser K
    alpha: float = 0.1               # diffuser restart probability
    stride: int | None = None        # strided (default: one row, W*C)
    pattern_seed: int = 0            # random edges of bigbird / diffuser
    backend: str = "auto"            # reference | cpu | triton | auto

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
        if min(self.height, self.width, self.layers, self.heads) < 1:
            raise ConfigError("model.height, width, layers and heads must be >= 1")
        if self.backend not in ("reference", "cpu", "triton", "auto"):
            raise ConfigError(f"model.backend must be reference, cpu, triton or auto, got {self.backend!r}")
        self.patterns()  # raises on bad pattern parameters
        return self

    def pattern_for(self, kind: str) -> Pattern:
        row = self.width * self.channels
        block = self.block or (32 if row < 64 else 64)  # the Triton kernels take blocks of 16..128
        if kind == "full":
            return make_pattern("full")
        if kind == "band":
            return make_pattern("band", window=self.window or 2 * row)
        if kind == "local2d":
            return make_pattern("local2d", height=self.height, width=self.width, channels=self.channels,
                                radius=self.radius, shift=1)
        if kind == "bigbird":
            return make_pattern("bigbird", block=block, window_blocks=self.window_blocks,
                                global_blocks=self.global_blocks, random_blocks=self.random_blocks,
                                seed=self.pattern_seed)
        if kind == "diffuser":
            return make_pattern("diffuser", window=self.window or row,
                                global_tokens=row if self.global_tokens is None else self.global_tokens,
                                random_edges=self.random_edges, steps=self.diffusion_steps, alpha=self.alpha,
                                seed=self.pattern_seed, block=block)
        if kind == "strided":
            return make_pattern("strided", stride=self.stride or row, shift=1)
        return make_pattern(kind)  # raises the "unknown pattern" ConfigError

    def patterns(self) -> list[Pattern]:
        kinds = [k.strip() for k in self.attention.split(",") if k.strip()]
        if not kinds:
            raise ConfigError("model.attention is empty; use e.g. --attention band")
        return [self.pattern_for(kinds[i % len(kinds)]).for_layer(i) for i in range(self.layers)]


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
    ckpt_every: int = 100
    log_every: int = 10
    seed: int = 0


@dataclass
class DataConfig:
    spec: str = "molecules"
    skip_bad: bool = False
    limit: int | None = None        # use at most this many images per split (quick runs)


@dataclass
class Config:
    preset: str = "demo"
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, d: dict) -> "Config":
        try:
            return cls(preset=d.get("preset", "custom"), model=ModelConfig(**d["model"]),
                       train=TrainConfig(**d.get("train", {})), data=DataConfig(**d.get("data", {})))
        except (TypeError, KeyError) as e:
            raise ConfigError(f"config is not an imggen config ({e}); was it written by another version?") from None


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
    "brats": dict(model=dict(height=64, width=64, channels=1, bits=8, dim=256, layers=8, heads=8,
                             attention="local2d,band", radius=4),
                  train=dict(steps=20000, batch_size=16, lr=1e-3, warmup=500, eval_every=1000,
                             ckpt_every=1000, sample_every=5000),
                  data=dict(spec="brats-demo")),
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

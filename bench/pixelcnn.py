"""A Gated PixelCNN (van den Oord et al. 2016, "Conditional Image Generation with PixelCNN Decoders"):
the density model a user would pick instead of imggen, written here as a reference, not shipped in imggen.

Grey images of one channel, 256-way softmax per pixel, no class conditioning. Two stacks remove the
blind spot of the masked PixelCNN:
- the vertical stack at row i sees rows <= i (a (k//2+1) x k convolution padded above and to the
  sides); it reaches the horizontal stack shifted down one row, so that there it carries rows < i;
- the horizontal stack at (i, j) sees row i, columns < j (the first layer reads the image shifted right
  by one: mask A) and columns <= j of its own features afterwards (mask B), with a residual connection.
Each layer is gated: tanh(a) * sigmoid(b) over the two halves of 2p channels.

`PixelCNNModel` wraps it in imggen's model interface (`config.bits/shape/vocab`, `model(tokens)` ->
logits (B, N, 256) where logits[:, t] is the distribution of token t given tokens < t), so that
imggen.eval.bpd scores it with the same code as an imggen model; `sample` draws pixel by pixel.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ImageSize:
    """The image fields of both PixelCNNs' configs, and their vocab, shape and seq_len."""
    height: int = 28
    width: int = 28
    channels: int = 1
    bits: int = 8

    @property
    def vocab(self) -> int:
        return 2 ** self.bits

    @property
    def shape(self) -> tuple[int, int, int]:
        return (self.channels, self.height, self.width)

    @property
    def seq_len(self) -> int:
        return self.height * self.width * self.channels


@dataclass
class PixelCNNConfig(ImageSize):
    filters: int = 64       # p: channels of each stack
    layers: int = 12        # gated layers
    kernel: int = 5         # odd
    head: int = 256         # hidden channels of the output head


def down_shift(x: torch.Tensor) -> torch.Tensor:
    """Row i gets row i-1 (zeros in row 0)."""
    return F.pad(x, (0, 0, 1, 0))[:, :, :-1]


def right_shift(x: torch.Tensor) -> torch.Tensor:
    """Column j gets column j-1 (zeros in column 0)."""
    return F.pad(x, (1, 0))[..., :-1]


class GatedLayer(nn.Module):
    def __init__(self, cin: int, p: int, k: int, first: bool):
        super().__init__()
        self.k, self.first = k, first
        self.v = nn.Conv2d(cin, 2 * p, (k // 2 + 1, k))        # padded above and to both sides
        self.h = nn.Conv2d(cin, 2 * p, (1, k // 2 + 1))        # padded on the left
        self.v_to_h = nn.Conv2d(2 * p, 2 * p, 1)
        self.h_out = nn.Conv2d(p, p, 1)

    @staticmethod
    def gate(x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=1)
        return torch.tanh(a) * torch.sigmoid(b)

    def forward(self, v: torch.Tensor, h: torch.Tensor):
        k = self.k
        v_pre = self.v(F.pad(v, (k // 2, k // 2, k // 2, 0)))           # row i: rows i-k//2 .. i
        h_in = right_shift(h) if self.first else h                      # mask A: not the pixel itself
        h_pre = self.h(F.pad(h_in, (k // 2, 0, 0, 0))) + self.v_to_h(down_shift(v_pre))
        h_new = self.h_out(self.gate(h_pre))
        return self.gate(v_pre), h_new if self.first else h + h_new


class GatedPixelCNN(nn.Module):
    def __init__(self, cfg: PixelCNNConfig):
        super().__init__()
        if cfg.kernel % 2 == 0 or cfg.kernel < 3:
            raise ValueError(f"kernel must be odd and >= 3, got {cfg.kernel}")
        self.cfg = cfg
        p = cfg.filters
        self.layers = nn.ModuleList(GatedLayer(cfg.channels if i == 0 else p, p, cfg.kernel, i == 0)
                                    for i in range(cfg.layers))
        self.out = nn.Sequential(nn.ReLU(), nn.Conv2d(p, cfg.head, 1), nn.ReLU(), nn.Conv2d(cfg.head, cfg.vocab, 1))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 or long pixel values (B, C=1, H, W) -> logits (B, 256, H, W); logits at (i, j) read only
        pixels before (i, j) in raster order."""
        x = images.to(self.out[1].weight.dtype) / ((self.cfg.vocab - 1) / 2) - 1
        v = h = x
        for layer in self.layers:
            v, h = layer(v, h)
        return self.out(h)


class PixelCNNModel(nn.Module):
    """imggen's model interface around a GatedPixelCNN: tokens (B, N) -> logits (B, N, vocab)."""

    def __init__(self, cfg: PixelCNNConfig):
        super().__init__()
        if cfg.channels != 1:
            raise ValueError("this Gated PixelCNN models grey images (channels=1)")
        self.config = cfg
        self.net = GatedPixelCNN(cfg)
        self.context = None

    def forward(self, tokens: torch.Tensor, context=None, nll: bool = False) -> torch.Tensor:
        """Logits (B, N, vocab); with nll=True, -log p of each token (B, N) (training's loss)."""
        c = self.config
        b, n = tokens.shape
        if n != c.seq_len:  # the convolutions see the whole grid: pad a prefix, read its logits
            tokens = F.pad(tokens, (0, c.seq_len - n))
        logits = self.net(tokens.view(b, 1, c.height, c.width))
        logits = logits.permute(0, 2, 3, 1).reshape(b, c.seq_len, c.vocab)[:, :n]
        if not nll:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, c.vocab), tokens[:, :n].reshape(-1),
                               reduction="none").view(b, n)

    @torch.no_grad()
    def sample(self, num: int, seed: int = 0, temperature: float = 1.0) -> torch.Tensor:
        """uint8 (num, 1, H, W): pixel by pixel, one full forward per pixel (the reference's way)."""
        c = self.config
        g = torch.Generator().manual_seed(seed)
        x = torch.zeros(num, c.seq_len, dtype=torch.long)
        was = self.training
        self.eval()
        for t in range(c.seq_len):
            logits = self(x[:, : t + 1])[:, t].float() / temperature
            x[:, t] = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)[:, 0]
        self.train(was)
        return x.view(num, 1, c.height, c.width).to(torch.uint8)

    def state(self) -> dict:
        return {"config": asdict(self.config), "weights": self.state_dict()}

    @classmethod
    def from_state(cls, state: dict) -> "PixelCNNModel":
        m = cls(PixelCNNConfig(**state["config"]))
        m.load_state_dict(state["weights"])
        return m

"""A PixelCNN++ (Salimans et al. 2017, "PixelCNN++: Improving the PixelCNN with Discretized Logistic
Mixture Likelihood and Other Modifications") for grey images: the strongest classic density model a
user would pick instead of imggen, written here as a reference, not shipped in imggen.

What the paper changes against the Gated PixelCNN (bench/pixelcnn.py), all here:
- a discretized logistic mixture likelihood (imggen.mixture: the same code imggen's mixture head uses)
  instead of a 256-way softmax;
- two streams without a blind spot: `u` sees the rows above (down-shifted 2x3 convolutions), `ul` the
  rows above and the pixels to the left (down-right-shifted 2x2 convolutions, plus `u`);
- gated ResNet blocks with concatenated ELUs, over three resolutions (28, 14, 7 for Fashion-MNIST):
  strided shifted convolutions down, transposed ones up, and skip connections from each block of the
  way down to its mirror on the way up (a U-Net);
- dropout, and Polyak averaging of the weights (bench/fashion.py trains it with an average and
  scores the average).
The image goes in with a channel of ones, so that the zero padding of the shifted convolutions is
told apart from black pixels, as in the paper's code.

`PixelCNNPPModel` has imggen's model interface (`config`, `model(tokens)` -> logits (B, N, 256) whose
position t reads only tokens < t, `model(tokens, nll=True)` -> -log p per token), so imggen.eval.bpd
scores it with the code that scores imggen.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from imggen import mixture
from pixelcnn import ImageSize, down_shift, right_shift


@dataclass
class PixelCNNPPConfig(ImageSize):
    filters: int = 64       # the paper: 160 (a GPU's week for CIFAR-10)
    resnets: int = 2        # gated ResNet blocks per resolution (the paper: 5)
    scales: int = 3         # resolutions (each halves height and width)
    mixture: int = 10       # logistic components
    dropout: float = 0.0    # the paper: 0.5 on CIFAR-10, whose models overfit; this budget does not


def concat_elu(x: torch.Tensor) -> torch.Tensor:
    return F.elu(torch.cat([x, -x], dim=1))


class DownShifted(nn.Module):
    """A (kh, kw) convolution whose output at row i reads rows <= i (padded above and to both sides);
    `right`: columns <= j too (padded above and on the left). Stride 2 halves the grid."""

    def __init__(self, cin, cout, k=(2, 3), stride=1, right=False):
        super().__init__()
        kh, kw = k
        self.pad = (kw - 1, 0, kh - 1, 0) if right else ((kw - 1) // 2, (kw - 1) // 2, kh - 1, 0)
        self.conv = nn.Conv2d(cin, cout, k, stride=stride)

    def forward(self, x):
        return self.conv(F.pad(x, self.pad))


class DownShiftedUp(nn.Module):
    """The transposed DownShifted of stride 2: doubles the grid, keeping what each position reads causal."""

    def __init__(self, cin, cout, k=(2, 3), right=False):
        super().__init__()
        self.k, self.right = k, right
        self.conv = nn.ConvTranspose2d(cin, cout, k, stride=2, output_padding=1)

    def forward(self, x):
        h, w = 2 * x.shape[2], 2 * x.shape[3]
        y = self.conv(x)
        c0 = 0 if self.right else (self.k[1] - 1) // 2
        return y[:, :, :h, c0:c0 + w]


class GatedResnet(nn.Module):
    """x + a * sigmoid(b), [a, b] = conv(concat_elu(conv(concat_elu(x)) + nin(concat_elu(skip))))."""

    def __init__(self, f, conv, skips=0, dropout=0.0):
        super().__init__()
        self.c1 = conv(2 * f, f)
        self.skip = nn.Conv2d(2 * skips * f, f, 1) if skips else None
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.c2 = conv(2 * f, 2 * f)

    def forward(self, x, skip=None):
        c = self.c1(concat_elu(x))
        if self.skip is not None:
            c = c + self.skip(concat_elu(skip))
        a, b = self.c2(self.drop(concat_elu(c))).chunk(2, dim=1)
        return x + a * torch.sigmoid(b)


class PixelCNNPP(nn.Module):
    def __init__(self, cfg: PixelCNNPPConfig):
        super().__init__()
        if cfg.height % 2 ** (cfg.scales - 1) or cfg.width % 2 ** (cfg.scales - 1):
            raise ValueError(f"{cfg.height}x{cfg.width} does not halve {cfg.scales - 1} times")
        self.cfg = cfg
        f, n, d = cfg.filters, cfg.resnets, cfg.dropout

        def u_conv(a, b):
            return DownShifted(a, b, (2, 3))

        def ul_conv(a, b):
            return DownShifted(a, b, (2, 2), right=True)

        self.u_in = DownShifted(cfg.channels + 1, f, (2, 3))
        self.ul_in_up = DownShifted(cfg.channels + 1, f, (1, 3))
        self.ul_in_left = DownShifted(cfg.channels + 1, f, (2, 1), right=True)
        self.up_u = nn.ModuleList(nn.ModuleList(GatedResnet(f, u_conv, 0, d) for _ in range(n)) for _ in range(cfg.scales))
        self.up_ul = nn.ModuleList(nn.ModuleList(GatedResnet(f, ul_conv, 1, d) for _ in range(n)) for _ in range(cfg.scales))
        self.down_u_stride = nn.ModuleList(DownShifted(f, f, (2, 3), 2) for _ in range(cfg.scales - 1))
        self.down_ul_stride = nn.ModuleList(DownShifted(f, f, (2, 2), 2, right=True) for _ in range(cfg.scales - 1))
        # on the way up the grid again: the first scale has n blocks, the others n + 1 (as the paper)
        counts = [n] + [n + 1] * (cfg.scales - 1)
        self.dn_u = nn.ModuleList(nn.ModuleList(GatedResnet(f, u_conv, 1, d) for _ in range(c)) for c in counts)
        self.dn_ul = nn.ModuleList(nn.ModuleList(GatedResnet(f, ul_conv, 2, d) for _ in range(c)) for c in counts)
        self.up_u_stride = nn.ModuleList(DownShiftedUp(f, f, (2, 3)) for _ in range(cfg.scales - 1))
        self.up_ul_stride = nn.ModuleList(DownShiftedUp(f, f, (2, 2), right=True) for _ in range(cfg.scales - 1))
        self.out = nn.Conv2d(f, 3 * cfg.mixture, 1)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Pixel values (B, 1, H, W) -> mixture parameters (B, 3K, H, W); those at (i, j) read only
        pixels before (i, j) in raster order."""
        x = images.to(self.out.weight.dtype) / ((self.cfg.vocab - 1) / 2) - 1
        x = torch.cat([x, torch.ones_like(x[:, :1])], dim=1)
        u = [down_shift(self.u_in(x))]
        ul = [down_shift(self.ul_in_up(x)) + right_shift(self.ul_in_left(x))]
        for s in range(self.cfg.scales):
            for bu, bul in zip(self.up_u[s], self.up_ul[s]):
                u.append(bu(u[-1]))
                ul.append(bul(ul[-1], u[-1]))
            if s < self.cfg.scales - 1:
                u.append(self.down_u_stride[s](u[-1]))
                ul.append(self.down_ul_stride[s](ul[-1]))
        a, b = u.pop(), ul.pop()
        for s in range(self.cfg.scales):
            for bu, bul in zip(self.dn_u[s], self.dn_ul[s]):
                a = bu(a, u.pop())
                b = bul(b, torch.cat([a, ul.pop()], dim=1))
            if s < self.cfg.scales - 1:
                a, b = self.up_u_stride[s](a), self.up_ul_stride[s](b)
        assert not u and not ul
        return self.out(F.elu(b))


class PixelCNNPPModel(nn.Module):
    """imggen's model interface around a PixelCNNPP: tokens (B, N) -> logits (B, N, vocab)."""
    scores_tokens = True

    def __init__(self, cfg: PixelCNNPPConfig):
        super().__init__()
        if cfg.channels != 1:
            raise ValueError("this PixelCNN++ models grey images (channels=1)")
        self.config = cfg
        self.net = PixelCNNPP(cfg)
        self.context = None

    def params(self, tokens: torch.Tensor) -> torch.Tensor:
        c = self.config
        b, n = tokens.shape
        if n != c.seq_len:  # the convolutions see the whole grid: pad a prefix, read its outputs
            tokens = F.pad(tokens, (0, c.seq_len - n))
        out = self.net(tokens.view(b, 1, c.height, c.width))
        return out.permute(0, 2, 3, 1).reshape(b, c.seq_len, out.shape[1])[:, :n].float()

    def forward(self, tokens: torch.Tensor, context=None, nll: bool = False) -> torch.Tensor:
        p = self.params(tokens)
        if nll:
            return mixture.token_nll(p, tokens, self.config.vocab)
        return mixture.log_probs(p, self.config.vocab)

    @torch.no_grad()
    def sample(self, num: int, seed: int = 0, temperature: float = 1.0) -> torch.Tensor:
        """uint8 (num, 1, H, W): pixel by pixel, one full forward per pixel (the reference's way)."""
        c = self.config
        g = torch.Generator().manual_seed(seed)
        x = torch.zeros(num, c.seq_len, dtype=torch.long)
        was = self.training
        self.eval()
        for t in range(c.seq_len):
            logits = self(x[:, : t + 1])[:, t] / temperature
            x[:, t] = torch.multinomial(torch.softmax(logits, -1), 1, generator=g)[:, 0]
        self.train(was)
        return x.view(num, 1, c.height, c.width).to(torch.uint8)

    def state(self) -> dict:
        return {"config": asdict(self.config), "weights": self.state_dict(), "kind": "pixelcnn++"}

    @classmethod
    def from_state(cls, state: dict) -> "PixelCNNPPModel":
        m = cls(PixelCNNPPConfig(**state["config"]))
        m.load_state_dict(state["weights"])
        return m

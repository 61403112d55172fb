"""The output head's likelihood: a discretized logistic mixture (PixelCNN++, Salimans et al. 2017).

A model with `model.mixture K` > 0 predicts, per token, K mixture weights, means and log scales
(3K numbers from its head) instead of 2**bits logits. Token x of V = 2**bits values is the bin
[c_x - 1/(V-1), c_x + 1/(V-1)] around c_x = 2x/(V-1) - 1 in [-1, 1]; the edge bins reach to -inf and
+inf. Each component gives a bin the difference of its logistic CDF at the bin's edges, so nearby
values share probability (127 is near 128), which a V-way softmax has to learn value by value.

`log_probs(params)` turns the parameters into V log-probabilities that sum to one: everything that
reads logits (bits/dim, sampling, the decode caches and the native C step) reads these. `token_nll`
is the negative log-likelihood of given tokens alone, O(K) per token (training's loss), and equals
`-log_probs(params).gather(tokens)`.

For sigmoid s, a bin between edges b < a: s(a) - s(b) = s(a) * s(-b) * (1 - exp(b - a)), so its
log is logsigmoid(a) + logsigmoid(-b) + log(-expm1(b - a)): exact and stable at any scale.

Base module: imports torch only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

MIN_LOG_SCALE = -7.0  # as PixelCNN++: scales below e^-7 (bins are 2/255 wide) only make the loss unstable


def head_width(mixture: int, vocab: int) -> int:
    """Outputs of the model's head: 3K mixture parameters, or `vocab` logits (mixture 0)."""
    return 3 * mixture if mixture else vocab


def _split(params: torch.Tensor):
    """(..., 3K) -> log mixture weights, means, inverse scales, log of the inner bins' width term."""
    k = params.shape[-1] // 3
    logit, mean, log_scale = params.float().split(k, dim=-1)
    log_scale = log_scale.clamp(min=MIN_LOG_SCALE)
    return F.log_softmax(logit, dim=-1), mean, torch.exp(-log_scale)


def _width_term(inv_scale: torch.Tensor, vocab: int) -> torch.Tensor:
    """log(1 - exp(-(2/(V-1)) / scale)): the factor of an inner bin, the same for every bin."""
    return torch.log(-torch.expm1(-(2.0 / (vocab - 1)) * inv_scale))


def log_probs(params: torch.Tensor, vocab: int) -> torch.Tensor:
    """Log-probabilities (..., vocab) of every token value under the mixture `params` (..., 3K)."""
    log_w, mean, inv_s = _split(params)
    centres = torch.linspace(-1.0, 1.0, vocab, device=params.device)
    half = 1.0 / (vocab - 1)
    upper = ((centres[:-1] + half) - mean[..., None]) * inv_s[..., None]  # (..., K, V-1): edges between bins
    ls_up = F.logsigmoid(upper)            # log CDF at the upper edge of bins 0..V-2
    ls_lo = ls_up - upper                  # logsigmoid(-edge): log (1 - CDF) at the lower edge of bins 1..V-1
    zero = ls_up.new_zeros(ls_up.shape[:-1] + (1,))
    inner = _width_term(inv_s, vocab)[..., None].expand_as(ls_up[..., 1:])
    per = (torch.cat([ls_up, zero], -1) + torch.cat([zero, ls_lo], -1)
           + torch.cat([zero, inner, zero], -1))  # (..., K, V); V == 2: no inner bins
    return torch.logsumexp(per + log_w[..., None], dim=-2)


def token_nll(params: torch.Tensor, tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """-log p(tokens) (shape of tokens), nats, under the mixture `params` (*tokens.shape, 3K)."""
    log_w, mean, inv_s = _split(params)
    x = tokens.to(mean.dtype)[..., None]
    centre = 2.0 * x / (vocab - 1) - 1.0
    half = 1.0 / (vocab - 1)
    upper = (centre + half - mean) * inv_s
    lower = (centre - half - mean) * inv_s
    top, bottom = x >= vocab - 1, x <= 0
    lp = (torch.where(top, 0.0, F.logsigmoid(upper)) + torch.where(bottom, 0.0, F.logsigmoid(-lower))
          + torch.where(top | bottom, 0.0, _width_term(inv_s, vocab)))
    return -torch.logsumexp(lp + log_w, dim=-1)

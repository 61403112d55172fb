"""Decode-step linears on CPU: weights repacked into contiguous column panels.

A decode step multiplies a few rows (one per sequence) by every weight of the model, so it is
bound by reading the weights. Measured on the 2-core test box: MKL's GEMMs x (16, in) @ W^T read
the weights of a brats-preset step (25 MB) at 2-3 GB/s, while a plain sum streams 13-17 GB/s.
`panel_linear` keeps, per layer, a copy of W^T cut into panels of PANEL output columns, each a
contiguous (in, PANEL) block, and runs one batched GEMM over the panels, every panel read front to
back: at 16 rows those linears ran 1.40-1.64x faster on two threads, 0.90-1.31x on one (three
runs, bench/RESULTS.md section 8). The copy is made once per decoding run and held by its caches,
so a run always sees the weights of its start. Where imggen.decode.native's kernels are available, the
panels feed them instead of `baddbmm` (`panel_linear`), and `native_step` hands a model's whole
decode step (embedding, blocks and head) to one native call.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from imggen.decode import native

# measured (bench/RESULTS.md section 8): 16 columns beat 32 and 64 in brats-preset steps (1 and 2
# threads); bench/panels.py, three runs: panels win up to 16 rows per thread (1 thread, 16 rows:
# 0.90-1.31x, 32 rows 0.69-1.09x; 2 threads, 32 rows: 1.11-1.43x, 64 rows 1.00-1.17x) and in the
# decode steps of models with more than ~6 MB of linear weights (smaller ones stay in the caches,
# where MKL wins)
PANEL = 16
ROWS_PER_THREAD = 16
MIN_BYTES = 6 << 20


def _pack(layer: nn.Linear):
    """(panels (P, in, PANEL), bias (P, 1, PANEL) or None): W^T in column panels, zero-padded."""
    return native.pack(layer.weight.detach(), None if layer.bias is None else layer.bias.detach(), PANEL)


def panel_linear(layer: nn.Linear, x: torch.Tensor, store: dict, ln: nn.LayerNorm | None = None,
                 act: bool = False, add: torch.Tensor | None = None) -> torch.Tensor:
    """reference_linear(layer, x, ln, act, add) for x (M, in): through the layer's weight panels
    (packed into `store` on first use) on CPU outside autograd for M <= ROWS_PER_THREAD * threads,
    in imggen.decode.native's kernel where it is available (float32), else the reference."""
    m = x.shape[0]
    if x.device.type != "cpu" or x.dim() != 2 or m > ROWS_PER_THREAD * torch.get_num_threads() \
            or torch.is_grad_enabled():
        return reference_linear(layer, x, ln, act, add)
    panels, bias = _packed(layer, store)
    if x.dtype == panels.dtype == torch.float32 and panels.shape[-1] == native.PANEL and native.available():
        return native.linear(x, panels, bias, layer.out_features, ln, act, add)
    if ln is not None:
        x = ln(x)
    xs = x.expand(panels.shape[0], m, x.shape[1])
    y = torch.bmm(xs, panels) if bias is None else torch.baddbmm(bias, xs, panels)  # (P, M, PANEL)
    y = y.transpose(0, 1).reshape(m, -1)
    y = y if y.shape[1] == layer.out_features else y[:, :layer.out_features]
    return _finish(y, act, add)


def _packed(layer: nn.Linear, store: dict):
    """The layer's (panels, bias), packed into `store` on first use."""
    if layer not in store:
        store[layer] = _pack(layer)
    return store[layer]


def _finish(y: torch.Tensor, act: bool, add: torch.Tensor | None) -> torch.Tensor:
    if act:
        y = F.gelu(y, approximate="tanh")
    return y if add is None else add + y


def reference_linear(layer: nn.Linear, x: torch.Tensor, ln: nn.LayerNorm | None = None, act: bool = False,
                     add: torch.Tensor | None = None) -> torch.Tensor:
    """[add +] act(layer(ln(x))): one linear of a decode step with what it fuses (act: GELU, tanh)."""
    return _finish(layer(x if ln is None else ln(x)), act, add)


def step_linear(model: nn.Module, caches):
    """linear(layer, x, ln=None, act=False, add=None) for the decode steps of `model` through
    `caches` (imggen.decode.make_caches): panel_linear, its panels held by the caches for that
    decoding run (whose keys and values are tied to the weights of that moment too), where
    imggen.decode.native's kernels are available or the model's Linear weights exceed MIN_BYTES (PyTorch
    panels, decode steps at batch 16 on 2 threads, three runs: 3.3 MB of weights 0.92-0.94x the
    speed, 7.3 MB 1.00-1.15x, 25 MB 1.05-1.29x); else reference_linear."""
    store = getattr(caches, "packed", None)
    if store is None:
        return reference_linear
    large = store.get("large")
    if large is None:
        large = store["large"] = is_large(model) or native.available()
    return functools.partial(panel_linear, store=store) if large else reference_linear


def native_step(model: nn.Module, caches):
    """imggen.decode.native.ModelStep for the decode steps of `model` through `caches` (its weights packed
    once into the caches' store), or None where some layer cannot take it (not float32 on CPU, a
    diffuser or grouped cache, debugging, no native kernels, autograd on)."""
    store = getattr(caches, "packed", None)
    if store is None or torch.is_grad_enabled():
        return None
    if "native" not in store:
        ok = all(getattr(c, "fused", False) for c in caches) and model.start.dtype == torch.float32 \
            and PANEL == native.PANEL
        store["native"] = native.ModelStep(_model_weights(model, store), [_block_weights(b, store) for b in model.blocks],
                                           caches, model.config.heads) if ok else None
    return store["native"]


def _model_weights(model: nn.Module, store: dict) -> dict:
    head, head_b = _packed(model.head, store)
    return dict(tok=model.tok_emb.weight.detach(), start=model.start.detach(), row=model.row_emb.weight.detach(),
                col=model.col_emb.weight.detach(), chan=model.chan_emb.weight.detach(), pos=model.pos_index,
                lnf_w=model.ln_f.weight.detach(), lnf_b=model.ln_f.bias.detach(), eps=model.ln_f.eps,
                head=head, head_b=None if head_b is None else head_b.reshape(-1), out=model.head.out_features)


def _block_weights(block: nn.Module, store: dict) -> dict:
    w = {}
    for name, layer in (("qkv", block.attn.qkv), ("proj", block.attn.proj), ("fc1", block.mlp[0]),
                        ("fc2", block.mlp[2])):
        panels, bias = _packed(layer, store)
        w[name], w[name + "_b"] = panels, None if bias is None else bias.reshape(-1)
    for i, ln in ((1, block.ln1), (2, block.ln2)):
        w[f"ln{i}_w"], w[f"ln{i}_b"], w[f"eps{i}"] = ln.weight.detach(), ln.bias.detach(), ln.eps
    w["hidden"] = block.mlp[0].out_features
    return w


def linear_bytes(model: nn.Module) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in model.modules() if isinstance(m, nn.Linear))


def is_large(model: nn.Module) -> bool:
    """Whether the model's Linear weights exceed MIN_BYTES (its CPU decode steps use panels)."""
    return linear_bytes(model) > MIN_BYTES

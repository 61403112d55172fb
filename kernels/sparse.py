"""Launchers, autograd and torch.library registration for block-sparse attention.

`sparse_attention(q, k, v, pattern, block=None)` is what `imggen.sparse_attention(..., backend="triton")`
calls. Softmax patterns go through the ops `imggen::bsa_fwd` / `imggen::bsa_bwd`, the diffuser through
`imggen::diffuser_fwd` / `imggen::diffuser_bwd`; each has a fake (meta) implementation and the
forward ops carry their backward via `register_autograd`, so the call works under torch.compile.
The pattern reaches the ops as a string key into a plan registry (ops take no Python objects).
"""
from __future__ import annotations

import math
import os

import torch

from imggen.errors import ShapeError
from imggen.patterns import Pattern

from . import attention as K
from .plan import Plan, make_plan, pick_block

POISON = os.environ.get("IMGGEN_KERNEL_POISON", "") == "1"  # tests: outputs start as NaN
HEAD_DIMS = (32, 64, 128)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PLANS: dict[str, tuple[Plan, Pattern]] = {}


def _empty(shape, dtype, device):
    if POISON:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "") == "1"


def check_device(t: torch.Tensor, what: str):
    if t.is_cuda:
        return
    if t.device.type == "cpu" and interpreted():
        return
    raise ShapeError(f"triton kernels: {what} is on {t.device}; they need CUDA tensors (or CPU tensors with "
                     f"TRITON_INTERPRET=1 set before importing imggen.kernels). On CPU use backend='cpu'.")


def check_qkv(q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ShapeError(f"triton sparse_attention: {name} must be a tensor, got {type(t).__name__}")
    if q.dim() != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ShapeError(f"triton sparse_attention: q, k, v must be (B, H, N, D) of one shape; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES:
        raise ShapeError(f"triton sparse_attention: q, k, v must share one dtype among float32, float16, "
                         f"bfloat16; got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ShapeError(f"triton sparse_attention: q, k, v on different devices {q.device}, {k.device}, {v.device}")
    check_device(q, "q")
    if q.shape[-1] not in HEAD_DIMS:
        raise ShapeError(f"triton sparse_attention: head dim D={q.shape[-1]} must be one of {HEAD_DIMS}; "
                         f"pad q, k, v to the next supported size or use backend='cpu'")
    if q.shape[2] < 1 or q.shape[0] < 1 or q.shape[1] < 1:
        raise ShapeError(f"triton sparse_attention: empty input of shape {tuple(q.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ShapeError(f"triton sparse_attention: {name} is not contiguous in its last dim "
                             f"(strides {t.stride()}); call .contiguous() first")


def _plan_key(pattern: Pattern, n: int, heads: int, block: int | None, device) -> str:
    block = pick_block(pattern, block, device)
    key = f"{pattern!r}|n={n}|h={heads}|block={block}|{torch.device(device)}"
    if key not in _PLANS:
        _PLANS[key] = (make_plan(pattern, n, heads, block, str(torch.device(device))), pattern)
    return key


def _launch_kw(q):
    if interpreted():
        return {}
    return {"num_warps": 8 if q.shape[-1] == 128 else 4, "num_stages": 2}


def _strides(*ts):
    out = []
    for t in ts:
        out += [t.stride(0), t.stride(1), t.stride(2)]
    return out


# ----------------------------------------------------------------------------- softmax patterns
@torch.library.custom_op("imggen::bsa_fwd", mutates_args=())
def bsa_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    plan, _ = _PLANS[key]
    b, h, n, d = q.shape
    o = _empty((b, h, n, d), q.dtype, q.device)
    lse = _empty((b, h, n), torch.float32, q.device)
    p0, p1, p2, p3 = plan.params
    K._fwd[(plan.nqb, b * h)](
        q, k, v, o, lse, o, plan.lay, plan.cnt, plan.rand, *_strides(q, k, v),
        h, n, plan.nqb, plan.m, plan.lay.shape[-1], plan.hdiff, K.LOG2E / math.sqrt(d), p0, p1, p2, p3,
        KIND=plan.kind, R=plan.r, BLOCK=plan.block, D=d, WRITE_O=True, WRITE_P=False,
        IEEE=q.dtype == torch.float32, **_launch_kw(q))
    return o, lse


@bsa_fwd.register_fake
def _(q, k, v, key):
    b, h, n, d = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((b, h, n), dtype=torch.float32)


@torch.library.custom_op("imggen::bsa_bwd", mutates_args=())
def bsa_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
            lse: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    plan, _ = _PLANS[key]
    b, h, n, d = q.shape
    do = do.contiguous()
    delta = (do.float() * o.float()).sum(-1).contiguous()
    dq = _empty((b, h, n, d), q.dtype, q.device)
    dk = _empty((b, h, n, d), q.dtype, q.device)
    dv = _empty((b, h, n, d), q.dtype, q.device)
    p0, p1, p2, p3 = plan.params
    sm2, scale = K.LOG2E / math.sqrt(d), 1.0 / math.sqrt(d)
    common = dict(KIND=plan.kind, R=plan.r, BLOCK=plan.block, D=d, IEEE=q.dtype == torch.float32, **_launch_kw(q))
    K._bwd_dq[(plan.nqb, b * h)](
        q, k, v, do, lse, delta, dq, plan.lay, plan.cnt, plan.rand, *_strides(q, k, v),
        h, n, plan.nqb, plan.lay.shape[-1], plan.hdiff, sm2, scale, p0, p1, p2, p3, **common)
    K._bwd_dkdv[(plan.nqb, b * h)](
        q, k, v, do, lse, delta, dk, dv, plan.tlay, plan.tcnt, plan.rand, *_strides(q, k, v),
        h, n, plan.nqb, plan.m, plan.tlay.shape[-1], plan.hdiff, sm2, scale, p0, p1, p2, p3, **common)
    return dq, dk, dv


@bsa_bwd.register_fake
def _(do, q, k, v, o, lse, key):
    return tuple(torch.empty_like(q, memory_format=torch.contiguous_format) for _ in range(3))


def _bsa_setup(ctx, inputs, output):
    q, k, v, key = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.key = key


def _bsa_backward(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = bsa_bwd(do, q, k, v, o, lse, ctx.key)
    return dq, dk, dv, None


bsa_fwd.register_autograd(_bsa_backward, setup_context=_bsa_setup)


# ------------------------------------------------------------------------------------ diffuser
def _spmm(plan: Plan, p, x, y, out, c1, c2, trans: bool):
    b, h, n, d = x.shape
    lay, cnt = (plan.tlay, plan.tcnt) if trans else (plan.lay, plan.cnt)
    K._spmm[(plan.nqb, b * h)](
        p, x, y if y is not None else x, out, lay, cnt, h, n, plan.nqb, plan.m, lay.shape[-1], plan.hdiff,
        float(c1), float(c2), TRANS=trans, HAS_Y=y is not None, BLOCK=plan.block, D=d,
        IEEE=x.dtype == torch.float32, **_launch_kw(x))
    return out


def _p_shape(plan: Plan, b, h):
    return (b, h, plan.nqb, plan.m, plan.block, plan.block)


def _p_dtype(dtype):
    """Storage dtype of the diffuser's A (and dS) blocks: the input's, but fp32 for fp32 inputs."""
    return torch.float32 if dtype == torch.float32 else dtype


@torch.library.custom_op("imggen::diffuser_fwd", mutates_args=())
def diffuser_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (Z_steps, A blocks (B, H, nqb, M, T, T), states Z_0..Z_(steps-1) (steps, B, H, N, D))."""
    plan, pat = _PLANS[key]
    b, h, n, d = q.shape
    p = _empty(_p_shape(plan, b, h), _p_dtype(q.dtype), q.device)
    lse = _empty((b, h, n), torch.float32, q.device)
    p0, p1, p2, p3 = plan.params
    K._fwd[(plan.nqb, b * h)](
        q, k, v, lse, lse, p, plan.lay, plan.cnt, plan.rand, *_strides(q, k, v),
        h, n, plan.nqb, plan.m, plan.lay.shape[-1], plan.hdiff, K.LOG2E / math.sqrt(d), p0, p1, p2, p3,
        KIND=plan.kind, R=plan.r, BLOCK=plan.block, D=d, WRITE_O=False, WRITE_P=True,
        IEEE=q.dtype == torch.float32, **_launch_kw(q))
    steps, a = pat.steps, pat.alpha
    zs = _empty((steps, b, h, n, d), q.dtype, q.device)
    zs[0].copy_(v)
    z = _empty((b, h, n, d), q.dtype, q.device)
    for s in range(1, steps + 1):
        _spmm(plan, p, zs[s - 1], zs[0], zs[s] if s < steps else z, 1.0 - a, a, trans=False)
    return z, p, zs


@diffuser_fwd.register_fake
def _(q, k, v, key):
    plan, pat = _PLANS[key]
    b, h, n, d = q.shape
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty(_p_shape(plan, b, h), dtype=_p_dtype(q.dtype)), q.new_empty((pat.steps, b, h, n, d)))


@torch.library.custom_op("imggen::diffuser_bwd", mutates_args=())
def diffuser_bwd(dz: torch.Tensor, q: torch.Tensor, k: torch.Tensor, p: torch.Tensor, zs: torch.Tensor,
                 key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    plan, pat = _PLANS[key]
    b, h, n, d = q.shape
    steps, a = pat.steps, pat.alpha
    g = _empty((steps, b, h, n, d), q.dtype, q.device)  # g[s] = dL/dZ_(s+1)
    g[steps - 1].copy_(dz)
    for s in range(steps - 1, 0, -1):
        _spmm(plan, p, g[s], None, g[s - 1], 1.0 - a, 0.0, trans=True)
    dz0 = _spmm(plan, p, g[0], None, _empty((b, h, n, d), q.dtype, q.device), 1.0 - a, 0.0, trans=True)
    dv = (a * torch.sum(g, 0, dtype=torch.float32) + dz0.float()).to(q.dtype)
    ds = _empty(p.shape, p.dtype, q.device)
    K._diff_ds[(plan.nqb, b * h)](
        p, g, zs, ds, plan.lay, plan.cnt, h, n, plan.nqb, plan.m, plan.lay.shape[-1], plan.hdiff,
        steps, b * h * n * d, 1.0 - a, BLOCK=plan.block, D=d, IEEE=q.dtype == torch.float32, **_launch_kw(q))
    scale = 1.0 / math.sqrt(d)
    dq = _spmm(plan, ds, k.contiguous(), None, _empty((b, h, n, d), q.dtype, q.device), scale, 0.0, trans=False)
    dk = _spmm(plan, ds, q.contiguous(), None, _empty((b, h, n, d), q.dtype, q.device), scale, 0.0, trans=True)
    return dq, dk, dv


@diffuser_bwd.register_fake
def _(dz, q, k, p, zs, key):
    return tuple(torch.empty_like(q, memory_format=torch.contiguous_format) for _ in range(3))


def _diff_setup(ctx, inputs, output):
    q, k, v, key = inputs
    _, p, zs = output
    ctx.save_for_backward(q, k, p, zs)
    ctx.key = key


def _diff_backward(ctx, dz, dp, dzs):
    q, k, p, zs = ctx.saved_tensors
    dq, dk, dv = diffuser_bwd(dz.contiguous(), q, k, p, zs, ctx.key)
    return dq, dk, dv, None


diffuser_fwd.register_autograd(_diff_backward, setup_context=_diff_setup)


# ------------------------------------------------------------------------------------ entry point
def sparse_attention(q, k, v, pattern: Pattern, block: int | None = None) -> torch.Tensor:
    """Block-sparse attention with the semantics of imggen.sparse_attention.reference_attention.

    q, k, v: (B, H, N, D) float32/float16/bfloat16, D in {32, 64, 128}, last dim contiguous.
    `block`: tile size (16/32/64/128; bigbird and diffuser tile by their own `block`).
    """
    if not isinstance(pattern, Pattern):
        raise TypeError(f"pattern must come from imggen.make_pattern, got {type(pattern).__name__}")
    check_qkv(q, k, v)
    key = _plan_key(pattern, q.shape[2], q.shape[1], block, q.device)
    if pattern.is_diffusion:
        return diffuser_fwd(q, k, v, key)[0]
    return bsa_fwd(q, k, v, key)[0]

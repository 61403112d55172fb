"""Launchers, autograd and torch.library registration for block-sparse attention.

`sparse_attention(q, k, v, pattern, block=None)` is what `imggen.sparse_attention(..., backend="triton")`
calls. Softmax patterns go through the ops `imggen::bsa_fwd` / `imggen::bsa_bwd`, the diffuser through
`imggen::diffuser_fwd` / `imggen::diffuser_bwd`; each has a fake (meta) implementation and the
forward ops carry their backward via `register_autograd`, so the call works under torch.compile.
The pattern reaches the ops as a string key into a registry (ops take no Python objects); each
launch picks its tile configuration from kernels.tuning and the plan for those tiles (kernels.plan).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import triton

from imggen.errors import ShapeError
from imggen.patterns import Pattern

from . import sparse_kernels as K
from . import tuning
from .plan import Plan, keeps_rule, layout_block, make_plan
from .tuning import HEAD_DIMS, Config

POISON = os.environ.get("IMGGEN_KERNEL_POISON", "") == "1"  # tests: outputs start as NaN
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass
class _Op:
    pattern: Pattern
    n: int
    heads: int
    lb: int                                                  # layout block (kernels.plan)
    widths: dict = field(default_factory=dict)               # diffuser: (bm, bn) -> table width M


_OPS: dict[str, _Op] = {}


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
    if not tuning.supported(q.shape[-1], q.dtype):
        raise ShapeError(f"triton sparse_attention: {str(q.dtype).replace('torch.', '')} with head dim "
                         f"{q.shape[-1]} has no kernel configuration that fits sm_90 (IEEE fp32 dots spill at "
                         f"every tile shape; see kernels.tuning); use bfloat16/float16 or backend='flex'")
    if q.shape[2] < 1 or q.shape[0] < 1 or q.shape[1] < 1:
        raise ShapeError(f"triton sparse_attention: empty input of shape {tuple(q.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ShapeError(f"triton sparse_attention: {name} is not contiguous in its last dim "
                             f"(strides {t.stride()}); call .contiguous() first")


def _plan_key(pattern: Pattern, n: int, heads: int, block: int | None, device) -> str:
    """Register (pattern, n, heads, layout block) for the ops; diffusion patterns also record the
    table width of every A-block shape they may store (the fake implementations need it)."""
    lb = layout_block(pattern, block)
    key = f"{pattern!r}|n={n}|h={heads}|lb={lb}|{torch.device(device)}"
    op = _OPS.setdefault(key, _Op(pattern, n, heads, lb))
    if pattern.is_diffusion:
        for c in _diffuser_tiles():
            if (c.bm, c.bn) not in op.widths:
                op.widths[(c.bm, c.bn)] = pattern.block_plan(n, heads, c.bm, c.bn).keys.shape[-1]
    return key


def _diffuser_tiles() -> list[Config]:
    forced = tuning.forced_config("diffuser")
    return [c for key, cs in tuning.CONFIGS.items() if key[0] == "diffuser" for c in cs] + ([forced] if forced else [])


def _launch_kw(cfg: Config) -> dict:
    return {} if interpreted() else cfg.launch()


def _strides(*ts):
    return [s for t in ts for s in t.stride()[:3]]


def _config(kernel: str, op: _Op, q: torch.Tensor, launch) -> Config:
    """Tiles for `kernel`: candidates that keep the pattern's own rule first; autotuned with
    `launch(config)` when IMGGEN_AUTOTUNE=1 on CUDA (see kernels.tuning)."""
    d = q.shape[-1]
    cands = sorted(tuning.candidates(kernel, d, q.dtype), key=lambda c: not keeps_rule(op.pattern, op.lb, c.bm, c.bn))

    def bench(cfg):
        return triton.testing.do_bench(lambda: launch(cfg))

    return tuning.choose(kernel, d, q.dtype, tuple(cands), key=(repr(op.pattern), op.lb, q.shape[0] * q.shape[1],
                                                                 op.n), bench=bench)


def _plan(op: _Op, cfg: Config, device) -> Plan:
    return make_plan(op.pattern, op.n, op.heads, op.lb, cfg.bm, cfg.bn, str(torch.device(device)))


def _fwd(plan: Plan, cfg: Config, q, k, v, o, lse, p, write_o: bool, write_p: bool):
    b, h, n, d = q.shape
    K._fwd[(plan.nqb, b * h)](
        q, k, v, o, lse, p, plan.lay, plan.cnt, plan.rand, plan.emask, *_strides(q, k, v),
        h, n, plan.nqb, plan.m, plan.mp, plan.hl, K.LOG2E.value / math.sqrt(d), **plan.rule_args(),
        BM=cfg.bm, BN=cfg.bn, D=d, WRITE_O=write_o, WRITE_P=write_p, IEEE=q.dtype == torch.float32,
        **_launch_kw(cfg))


def _parts(plan: Plan, x: torch.Tensor):
    """fp32 partial results of split key tiles (a dummy when no row is split)."""
    b, h, _, d = x.shape
    return torch.empty((b * h, plan.nparts, plan.bn, d) if plan.nparts else (1,), dtype=torch.float32,
                       device=x.device)


def _flush(plan: Plan, parts, out):
    """Sum the partial results of split key tiles into `out` (a (B, H, N, D) view)."""
    if not plan.ns:
        return
    b, h, n, d = out.shape
    cfg = tuning.choose("flush", d, out.dtype, tuning.candidates("flush", d, out.dtype))
    K._flush[(plan.ns, b * h)](parts, out, plan.flush, h, plan.hl, n, plan.ns, plan.nparts, *_strides(out),
                               BN=plan.bn, D=d, **_launch_kw(cfg))


# ----------------------------------------------------------------------------- softmax patterns
@torch.library.custom_op("imggen::bsa_fwd", mutates_args=())
def bsa_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor]:
    op = _OPS[key]
    b, h, n, d = q.shape
    o = _empty((b, h, n, d), q.dtype, q.device)
    lse = _empty((b, h, n), torch.float32, q.device)

    def launch(cfg):
        _fwd(_plan(op, cfg, q.device), cfg, q, k, v, o, lse, lse, write_o=True, write_p=False)

    launch(_config("fwd", op, q, launch))
    return o, lse


@bsa_fwd.register_fake
def _(q, k, v, key):
    b, h, n, d = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((b, h, n), dtype=torch.float32)


@torch.library.custom_op("imggen::bsa_bwd", mutates_args=())
def bsa_bwd(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
            lse: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    op = _OPS[key]
    b, h, n, d = q.shape
    do, o = do.contiguous(), o.contiguous()
    sm2, scale, ieee = K.LOG2E.value / math.sqrt(d), 1.0 / math.sqrt(d), q.dtype == torch.float32
    delta = _empty((b, h, n), torch.float32, q.device)
    pre = tuning.choose("pre", d, q.dtype, tuning.candidates("pre", d, q.dtype))
    K._bwd_pre[(triton.cdiv(n, pre.bm), b * h)](o, do, delta, n, BM=pre.bm, D=d, **_launch_kw(pre))
    dq = _empty((b, h, n, d), q.dtype, q.device)
    dk = _empty((b, h, n, d), q.dtype, q.device)
    dv = _empty((b, h, n, d), q.dtype, q.device)

    def launch_dq(cfg):
        plan = _plan(op, cfg, q.device)
        K._bwd_dq[(plan.nqb, b * h)](
            q, k, v, do, lse, delta, dq, plan.lay, plan.cnt, plan.rand, plan.emask, *_strides(q, k, v),
            h, n, plan.nqb, plan.m, plan.mp, plan.hl, sm2, scale, **plan.rule_args(),
            BM=cfg.bm, BN=cfg.bn, D=d, IEEE=ieee, **_launch_kw(cfg))

    def launch_dkdv(cfg):
        plan = _plan(op, cfg, q.device)
        dkp, dvp = _parts(plan, q), _parts(plan, q)
        K._bwd_dkdv[(plan.ni, b * h)](
            q, k, v, do, lse, delta, dk, dv, dkp, dvp, plan.tlay, plan.tcnt, plan.items, plan.rand, plan.emask,
            *_strides(q, k, v), h, n, plan.nqb, plan.nkb, plan.m, plan.mp, plan.tlay.shape[-1], plan.ni,
            plan.nparts, plan.hl, sm2, scale, **plan.rule_args(), BM=cfg.bm, BN=cfg.bn, D=d, IEEE=ieee,
            **_launch_kw(cfg))
        _flush(plan, dkp, dk)
        _flush(plan, dvp, dv)

    launch_dq(_config("dq", op, q, launch_dq))
    launch_dkdv(_config("dkdv", op, q, launch_dkdv))
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
def _diffuser(q) -> Config:
    """The diffuser's A-block shape: one per head dim and precision (fixed before tracing)."""
    d = q.shape[-1]
    return tuning.choose("diffuser", d, q.dtype, tuning.candidates("diffuser", d, q.dtype))


def _spmm(plan: Plan, cfg: Config, p, x, out, parts, c1: float, y=None, c2: float = 0.0, ky: int = 1,
          ky_stride: int = 0, trans: bool = False):
    """out = c1 * (A or A^T) @ x + c2 * sum of `ky` chunks of y (see kernels.sparse_kernels._spmm)."""
    b, h, n, d = x.shape
    yy = x if y is None else y
    K._spmm[(plan.ni if trans else plan.nqb, b * h)](
        p, x, yy, out, parts, plan.lay, plan.cnt, plan.tlay, plan.items, h, plan.hl, n, plan.nqb, plan.nkb,
        plan.m, plan.tlay.shape[-1], plan.ni, plan.nparts, *_strides(x, yy), ky_stride, ky, *_strides(out),
        float(c1), float(c2), TRANS=trans, HAS_Y=y is not None, BM=cfg.bm, BN=cfg.bn, D=d,
        IEEE=x.dtype == torch.float32, **_launch_kw(cfg))
    if trans:
        _flush(plan, parts, out)
    return out


def _p_shape(op: _Op, cfg: Config, b, h):
    return (b, h, math.ceil(op.n / cfg.bm), op.widths[(cfg.bm, cfg.bn)], cfg.bm, cfg.bn)


def _p_dtype(dtype):
    """Storage dtype of the diffuser's A (and dS) blocks: the input's, but fp32 for fp32 inputs."""
    return torch.float32 if dtype == torch.float32 else dtype


@torch.library.custom_op("imggen::diffuser_fwd", mutates_args=())
def diffuser_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: str
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (Z_steps, A blocks (B, H, nqb, M, BM, BN), states Z_0..Z_(steps-1) (B, H, N, steps, D))."""
    op = _OPS[key]
    pat = op.pattern
    b, h, n, d = q.shape
    cfg = _diffuser(q)
    plan = _plan(op, cfg, q.device)
    p = _empty(_p_shape(op, cfg, b, h), _p_dtype(q.dtype), q.device)
    lse = _empty((b, h, n), torch.float32, q.device)
    _fwd(plan, cfg, q, k, v, lse, lse, p, write_o=False, write_p=True)
    steps, a = pat.steps, pat.alpha
    zs = _empty((b, h, n, steps, d), q.dtype, q.device)
    zs[:, :, :, 0].copy_(v)
    z = _empty((b, h, n, d), q.dtype, q.device)
    for s in range(1, steps + 1):
        _spmm(plan, cfg, p, zs[:, :, :, s - 1], zs[:, :, :, s] if s < steps else z, None, 1.0 - a, y=v, c2=a)
    return z, p, zs


@diffuser_fwd.register_fake
def _(q, k, v, key):
    op = _OPS[key]
    b, h, n, d = q.shape
    cfg = _diffuser(q)
    return (torch.empty_like(q, memory_format=torch.contiguous_format),
            q.new_empty(_p_shape(op, cfg, b, h), dtype=_p_dtype(q.dtype)), q.new_empty((b, h, n, op.pattern.steps, d)))


@torch.library.custom_op("imggen::diffuser_bwd", mutates_args=())
def diffuser_bwd(dz: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, z: torch.Tensor,
                 p: torch.Tensor, zs: torch.Tensor, key: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    op = _OPS[key]
    b, h, n, d = q.shape
    steps, a = op.pattern.steps, op.pattern.alpha
    cfg = _diffuser(q)
    plan = _plan(op, cfg, q.device)
    parts = _parts(plan, q)
    g = _empty((b, h, n, steps, d), q.dtype, q.device)  # g[.., s, :] = dL/dZ_(s+1)
    g[:, :, :, steps - 1].copy_(dz)
    for s in range(steps - 1, 0, -1):
        _spmm(plan, cfg, p, g[:, :, :, s], g[:, :, :, s - 1], parts, 1.0 - a, trans=True)
    # dV = (1 - a) A^T G_0 + a sum_s G_s
    dv = _spmm(plan, cfg, p, g[:, :, :, 0], _empty((b, h, n, d), q.dtype, q.device), parts, 1.0 - a,
               y=g[:, :, :, 0], c2=a, ky=steps, ky_stride=g.stride(3), trans=True)
    ds = _empty(p.shape, p.dtype, q.device)
    dq = _empty((b, h, n, d), q.dtype, q.device)
    scale = 1.0 / math.sqrt(d)
    K._diff_ds[(plan.nqb, b * h)](
        p, ds, g, zs, z.contiguous(), v, k, dq, plan.lay, plan.cnt, h, plan.hl, n, plan.nqb, plan.m, steps,
        *_strides(v, k), 1.0 - a, a, scale, BM=cfg.bm, BN=cfg.bn, D=d, IEEE=q.dtype == torch.float32,
        **_launch_kw(cfg))
    dk = _spmm(plan, cfg, ds, q, _empty((b, h, n, d), q.dtype, q.device), parts, scale, trans=True)
    return dq, dk, dv


@diffuser_bwd.register_fake
def _(dz, q, k, v, z, p, zs, key):
    return tuple(torch.empty_like(q, memory_format=torch.contiguous_format) for _ in range(3))


def _diff_setup(ctx, inputs, output):
    q, k, v, key = inputs
    z, p, zs = output
    ctx.save_for_backward(q, k, v, z, p, zs)
    ctx.key = key


def _diff_backward(ctx, dz, dp, dzs):
    q, k, v, z, p, zs = ctx.saved_tensors
    dq, dk, dv = diffuser_bwd(dz.contiguous(), q, k, v, z, p, zs, ctx.key)
    return dq, dk, dv, None


diffuser_fwd.register_autograd(_diff_backward, setup_context=_diff_setup)


# ------------------------------------------------------------------------------------ entry point
def sparse_attention(q, k, v, pattern: Pattern, block: int | None = None) -> torch.Tensor:
    """Block-sparse attention with the semantics of imggen.attention.reference_attention.

    q, k, v: (B, H, N, D) float32/float16/bfloat16, D in {32, 64, 128}, last dim contiguous.
    `block`: the layout block handed to `pattern.kernel_spec` (16/32/64/128; default: the largest
    size with an arithmetic rule, e.g. bigbird's own block). Kernel tiles come from kernels.tuning.
    Patterns with head groups (strided) are split by imggen.attention before they get here.
    """
    if not isinstance(pattern, Pattern):
        raise TypeError(f"pattern must come from imggen.make_pattern, got {type(pattern).__name__}")
    check_qkv(q, k, v)
    key = _plan_key(pattern, q.shape[2], q.shape[1], block, q.device)
    if pattern.is_diffusion:
        return diffuser_fwd(q, k, v, key)[0]
    return bsa_fwd(q, k, v, key)[0]

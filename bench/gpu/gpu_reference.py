"""What bench/gpu/gpu_bench.py checks its numbers against: fp32 softmax and diffuser attention with exact
gradients, straight from pattern.allowed in query chunks (never a block layout), the error metrics
(rel and worst row, see CONVENTIONS in gpu_targets.py), the allowed-pair counts behind the useful
FLOPs, and the diffuser's graph as one softmax attention (the denominator of its target).
"""
from __future__ import annotations

import dataclasses
import math

import torch

from harness import fmt

def allowed_tables(pattern, n: int, heads: int, device) -> dict:
    return {k: t.to(device) for k, t in pattern.lookup_tables(n, pattern.head_count(heads)).items()}


def _chunk_rows(n_keys: int, chunk_elems: int) -> int:
    return max(1, min(n_keys, chunk_elems // max(1, n_keys)))


def count_pairs(pattern, n: int, heads: int, device, chunk_elems: int = 1 << 27) -> list[int]:
    """Allowed (query, key) pairs per head (length `heads`), from pattern.allowed in query chunks."""
    hl = pattern.head_count(heads)
    tables = allowed_tables(pattern, n, heads, device)
    idx = torch.arange(n, device=device)
    c = _chunk_rows(n, chunk_elems)
    counts = [sum(int(pattern.allowed(idx[a:a + c, None], idx[None, :a + c], h, tables).sum())
                  for a in range(0, n, c)) for h in range(1 if hl == 1 else heads)]
    return counts * heads if hl == 1 else counts


def ref_softmax_head(pattern, q, k, v, do, head: int, tables, chunk_elems: int):
    """fp32 softmax attention of one head (q, k, v, do: (N, D)) and its exact gradients, in query
    chunks over the causal keys, masked by pattern.allowed. Returns o, dq, dk, dv."""
    n, d = q.shape
    scale = d ** -0.5
    idx = torch.arange(n, device=q.device)
    o, dq = torch.empty_like(q), torch.empty_like(q)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    a = 0
    while a < n:
        b = min(n, a + _chunk_rows(n, chunk_elems))
        m = pattern.allowed(idx[a:b, None], idx[None, :b], head, tables)
        s = (q[a:b] @ k[:b].T) * scale
        p = torch.softmax(s.masked_fill(~m, float("-inf")), dim=-1)  # the diagonal is always allowed
        del s, m
        o[a:b] = p @ v[:b]
        g = do[a:b]
        dv[:b] += p.T @ g
        dp = g @ v[:b].T
        ds = p * (dp - (g * o[a:b]).sum(-1, keepdim=True))
        del dp, p
        dq[a:b] = (ds @ k[:b]) * scale
        dk[:b] += (ds.T @ q[a:b]) * scale
        del ds
        a = b
    return o, dq, dk, dv


def ref_diffuser_head(pattern, q, k, v, do, head: int, tables, chunk_elems: int):
    """fp32 diffuser of one head with exact gradients: A = row-softmax over the mask (dense N x N,
    built in query chunks), Z0 = V, Z(k+1) = (1 - a) A Z(k) + a V, output Z(K)."""
    n, d = q.shape
    scale, steps, al = d ** -0.5, pattern.steps, pattern.alpha
    idx = torch.arange(n, device=q.device)
    A = torch.zeros(n, n, device=q.device, dtype=q.dtype)
    a = 0
    while a < n:
        b = min(n, a + _chunk_rows(n, chunk_elems))
        m = pattern.allowed(idx[a:b, None], idx[None, :b], head, tables)
        s = (q[a:b] @ k[:b].T) * scale
        A[a:b, :b] = torch.softmax(s.masked_fill(~m, float("-inf")), dim=-1)
        del s, m
        a = b
    zs = [v]
    for _ in range(steps):
        zs.append((1 - al) * (A @ zs[-1]) + al * v)
    o = zs[-1]
    g = do                        # dL/dZ(K)
    dv = al * g
    dA = torch.zeros_like(A)
    for s_ in range(steps - 1, -1, -1):   # Z(s_+1) = (1-a) A Z(s_) + a V
        dA.addmm_(g, zs[s_].T, alpha=1 - al)
        g = (1 - al) * (A.T @ g)  # dL/dZ(s_)
        dv = dv + (al * g if s_ >= 1 else g)
    ds = dA.sub_((dA * A).sum(-1, keepdim=True)).mul_(A)  # in place: A (N x N) may be large
    del A
    dq = (ds @ k) * scale
    dk = (ds.T @ q) * scale
    return o, dq, dk, dv


def reference_head(pattern, q, k, v, do, head, tables, chunk_elems):
    fn = ref_diffuser_head if pattern.is_diffusion else ref_softmax_head
    return fn(pattern, q, k, v, do, head, tables, chunk_elems)


class ErrAcc:
    """rel = ||x - ref|| / ||ref|| over everything added; row = worst row error (see CONVENTIONS)."""

    def __init__(self):
        self.num = self.den = 0.0
        self.row = 0.0
        self.where = None  # flat index of the worst row in the tensor that held it
        self.nan = False

    def add(self, x, ref):
        x, ref = x.float().reshape(-1, x.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
        if not torch.isfinite(x).all():
            self.nan = True
        diff = (x - ref).norm(dim=-1)
        rn = ref.norm(dim=-1)
        floor = rn.median().clamp(min=1e-12)
        self.num += float((diff ** 2).sum())
        self.den += float((rn ** 2).sum())
        worst = diff / torch.maximum(rn, floor)
        if float(worst.max()) >= self.row:
            self.row, self.where = float(worst.max()), int(worst.argmax())

    def result(self, tol: dict) -> dict:
        rel = math.inf if self.nan else math.sqrt(self.num) / max(math.sqrt(self.den), 1e-30)
        row = math.inf if self.nan else self.row
        return {"rel": rel, "row": row, "worst_row_index": self.where,
                "ok": bool(rel <= tol["rel"] and row <= tol["row"])}


NAMES = ("out", "dq", "dk", "dv")


def compare(xs, refs, tol) -> dict:
    res = {}
    for name, x, r in zip(NAMES, xs, refs):
        if x is None or r is None:
            continue
        acc = ErrAcc()
        acc.add(x, r)
        res[name] = acc.result(tol)
    res["ok"] = bool(res) and all(v["ok"] for k, v in res.items() if k in NAMES)
    return res


def check_vs_reference(pattern, inputs, outs, slices, tol, chunk_elems) -> dict:
    """outs (o, dq, dk, dv) of shape (B, H, N, D) vs the fp32 reference on the (b, h) slices."""
    q, k, v, do = inputs
    n, heads = q.shape[2], q.shape[1]
    tables = allowed_tables(pattern, n, heads, q.device)
    accs = {name: ErrAcc() for name in NAMES}
    for b, h in slices:
        ref = reference_head(pattern, *(t[b, h].detach().float() for t in (q, k, v, do)),
                             h if pattern.heads_differ else 0, tables, chunk_elems)
        for name, x, r in zip(NAMES, outs, ref):
            if x is not None:
                accs[name].add(x[b, h], r)
        del ref
    res = {name: acc.result(tol) for name, acc in accs.items() if outs[NAMES.index(name)] is not None}
    res["ok"] = all(v["ok"] for v in res.values())
    res["slices"] = [list(s) for s in slices]
    return res


def pick_slices(b: int, h: int, count: int) -> list[tuple[int, int]]:
    cand = [(0, 0), (b - 1, h - 1), (0, h // 2), (b // 2, 1 % h), (0, h - 1), (b - 1, 0)]
    out = []
    for s in cand:
        if s not in out:
            out.append(s)
    return out[:count]


def errs(c) -> str:
    """A comparison's errors in one line: 'out rel/row, dq rel/row, ...'."""
    return ", ".join(f"{n} {fmt(c[n]['rel'])}/{fmt(c[n]['row'])}" for n in NAMES if n in c)


def softmax_twin(pattern, table: bool = False):
    """The same pattern (same graph) as a plain softmax attention: a subclass of its class with
    is_diffusion off (table=True also hands the kernels per-block element masks instead of the
    pattern's arithmetic rule)."""
    from imggen.patterns import KernelSpec

    cls = type(pattern)
    if (cls, table) not in _TWINS:  # one class per (pattern class, table): equal twins share caches
        ns = {"is_diffusion": False, "__module__": __name__,
              "__qualname__": cls.__qualname__ + ("SoftmaxTable" if table else "Softmax")}
        if table:
            ns["kernel_spec"] = lambda self, tile: KernelSpec()
        _TWINS[cls, table] = type(ns["__qualname__"], (cls,), ns)
    return _TWINS[cls, table](**{f.name: getattr(pattern, f.name) for f in dataclasses.fields(pattern)})


_TWINS: dict = {}


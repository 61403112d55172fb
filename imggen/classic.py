"""Classic fills of a hole: biharmonic inpainting, the baseline every imggen fill is measured against.

`biharmonic(values, mask, spacing=None)` fills the True voxels of an n-D array so that the discrete
bilaplacian vanishes on them: the smooth guess that joins the known tissue without a seam (value and
slope continue across the hole's edge). The equations are skimage's
(`skimage.restoration.inpaint_biharmonic`, the reference the tests compare against, also its clip to
the known voxels' range), but they are solved by conjugate gradients: on a 240x240x155 volume with a
hole of 3% of the brain skimage's direct solver takes about 100 s, this about 3 s.

The fill minimises the squared discrete Laplacian, summed over every voxel whose Laplacian reads a
hole voxel (its normal equations are skimage's rows: the bilaplacian is zero on the hole). `spacing`
(the voxel size per axis) weighs each axis' second difference by 1 / spacing^2, so the fill is that of
physical space on an anisotropic grid. Hole voxels whose stencils interact are solved together, each
group in its own box with two voxels of margin (a box at the array's edge repeats the edge voxels).

`biharmonic_slices` fills slice by slice along one axis (the 2-D per-slice baseline).
"""
from __future__ import annotations

import numpy as np

MARGIN = 2  # the bilaplacian's reach


def _laplacian(shape, spacing):
    import scipy.sparse as sp

    lap = None
    for ax, n in enumerate(shape):
        d2 = sp.diags([np.ones(n - 1), -2.0 * np.ones(n), np.ones(n - 1)], [-1, 0, 1]) / spacing[ax] ** 2
        term = None
        for a, m in enumerate(shape):
            f = d2 if a == ax else sp.identity(m)
            term = f if term is None else sp.kron(term, f)
        lap = term if lap is None else lap + term
    return lap.tocsr()


def _solve_box(v: np.ndarray, m: np.ndarray, spacing, rtol: float) -> np.ndarray:
    """The hole values of one box (hole at least MARGIN voxels from its sides), in m's C order."""
    import scipy.sparse as sp
    from scipy.sparse.linalg import cg

    lap = _laplacian(v.shape, spacing)
    flat = m.ravel()
    hole, known = np.flatnonzero(flat), np.flatnonzero(~flat)
    lh = lap[:, hole].tocsr()
    rows = np.flatnonzero(np.diff(lh.indptr) > 0)  # voxels whose Laplacian reads a hole voxel
    lh, lk = lh[rows], lap[rows][:, known]
    a = (lh.T @ lh).tocsr()
    b = -(lh.T @ (lk @ v.ravel()[known]))
    u, info = cg(a, b, rtol=rtol, atol=0.0, maxiter=50 * len(hole) + 1000, M=sp.diags(1.0 / a.diagonal()))
    if info != 0:  # not converged: the direct solver (slow, exact)
        from scipy.sparse.linalg import spsolve

        u = spsolve(a.tocsc(), b)
    return u


def biharmonic(values, mask, spacing=None, rtol: float = 1e-9) -> np.ndarray:
    """float64 copy of `values` (n-D) with the True voxels of `mask` (same shape) filled; an empty
    mask returns the copy, a mask with no known voxel raises ValueError."""
    from scipy import ndimage

    v = np.array(values, np.float64)
    mask = np.asarray(mask, bool)
    if mask.shape != v.shape:
        raise ValueError(f"mask {mask.shape} and values {v.shape} differ in shape")
    if not mask.any():
        return v
    if mask.all():
        raise ValueError("the mask covers every voxel: nothing known to fill from")
    spacing = np.ones(v.ndim) if spacing is None else np.asarray(spacing, np.float64)
    lo_val, hi_val = v[~mask].min(), v[~mask].max()
    groups, _ = ndimage.label(ndimage.binary_dilation(mask, np.ones((3,) * v.ndim, bool)),
                              np.ones((3,) * v.ndim, bool))
    for i, box in enumerate(ndimage.find_objects(groups), start=1):
        hole = mask[box] & (groups[box] == i)
        lo = [s.start - MARGIN for s in box]
        hi = [s.stop + MARGIN for s in box]
        inner = tuple(slice(max(a, 0), min(b, n)) for a, b, n in zip(lo, hi, v.shape))
        pad = [(max(0, -a), max(0, b - n)) for a, b, n in zip(lo, hi, v.shape)]
        sub = np.pad(v[inner], pad, mode="edge")
        m = np.pad(mask[inner] & (groups[inner] == i), pad)
        u = _solve_box(sub, m, spacing, rtol)
        filled = np.zeros(m.shape)
        filled[m] = u
        off = [p[0] + s.start - t.start for p, s, t in zip(pad, box, inner)]
        v[box][hole] = filled[tuple(slice(o, o + s.stop - s.start) for o, s in zip(off, box))][hole]
    np.clip(v, lo_val, hi_val, out=v, where=mask)
    return v


def biharmonic_slices(values, mask, axis: int = -1, spacing=None) -> np.ndarray:
    """`biharmonic` of every slice along `axis` on its own (slices without a hole are copied)."""
    v = np.moveaxis(np.array(values, np.float64), axis, 0)
    m = np.moveaxis(np.asarray(mask, bool), axis, 0)
    sp = None if spacing is None else [s for a, s in enumerate(spacing) if a != axis % v.ndim]
    for k in np.flatnonzero(m.reshape(len(m), -1).any(1)):
        v[k] = biharmonic(v[k], m[k], sp)
    return np.moveaxis(v, 0, axis)

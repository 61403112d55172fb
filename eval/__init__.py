"""Evaluation: bits/dim, PSNR/SSIM (+ BraTS 2023 inpainting protocol), FID, atom-bond accuracy.

Public API: bits_per_dim, psnr, ssim, frechet_distance, atom_bond_accuracy.
Submodules import their heavy dependencies lazily so `import imggen.eval` stays cheap.
"""
from __future__ import annotations


def bits_per_dim(model, images, **kw) -> float:
    from imggen.eval.bpd import bits_per_dim as f
    return f(model, images, **kw)


def psnr(pred, target, mask=None, data_range=255) -> float:
    from imggen.eval.metrics import psnr as f
    return f(pred, target, mask=mask, data_range=data_range)


def ssim(pred, target, mask=None, data_range=255) -> float:
    from imggen.eval.metrics import ssim as f
    return f(pred, target, mask=mask, data_range=data_range)


def frechet_distance(mu1, sigma1, mu2, sigma2) -> float:
    from imggen.eval.fid import frechet_distance as f
    return f(mu1, sigma1, mu2, sigma2)


def atom_bond_accuracy(images, smiles=None, **kw) -> dict:
    from imggen.eval.atoms import atom_bond_accuracy as f
    return f(images, smiles=smiles, **kw)

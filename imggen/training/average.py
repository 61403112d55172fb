"""An exponential moving average of the weights (Polyak averaging; `--train.ema DECAY`, 0 = off).

After every optimiser step the average moves toward the trained weights:
    avg <- d * avg + (1 - d) * w,   d = min(DECAY, (1 + step) / (10 + step)),
so the first steps are not frozen at the initialisation. The average is the model a run gives:
validation, the sample grids, the test figure and every checkpoint's model.safetensors hold it, so
`imggen.load_model` and `sample.py` read the averaged model. The trained weights themselves travel
in the checkpoint's state.pt (key "trained"), from which `--resume` continues exactly: the
optimizer keeps working on the trained weights, and the average on its own copy.

Part of imggen.training; imports torch and imggen.errors.
"""
from __future__ import annotations

import contextlib

import torch

from imggen.errors import CheckpointError


class WeightAverage:
    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.names, self.params = zip(*model.named_parameters())
        self.avg = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self, step: int) -> None:
        """After optimiser step `step` (0-based)."""
        d = min(self.decay, (1 + step) / (10 + step))
        torch._foreach_lerp_(self.avg, [p.detach() for p in self.params], 1.0 - d)

    @torch.no_grad()
    def _swap(self) -> None:
        for p, a in zip(self.params, self.avg):
            tmp = p.detach().clone()
            p.copy_(a)
            a.copy_(tmp)

    @contextlib.contextmanager
    def applied(self):
        """The model holds the averaged weights inside the block, the trained ones again after it."""
        self._swap()
        try:
            yield
        finally:
            self._swap()

    def trained(self) -> dict:
        """The trained weights (outside `applied`: the model's own), by parameter name, for state.pt."""
        return {n: p.detach().clone().cpu() for n, p in zip(self.names, self.params)}

    @torch.no_grad()
    def restore(self, trained: dict | None) -> None:
        """--resume: the model was loaded with the checkpoint's weights. They become the average, and
        the trained weights of its state.pt (None: a run saved without an average) go into the model."""
        for a, p in zip(self.avg, self.params):
            a.copy_(p)
        load_trained(dict(zip(self.names, self.params)), trained)


@torch.no_grad()
def load_trained(params: dict, trained: dict | None) -> None:
    """Copy state.pt's trained weights (None: none saved) into the model's parameters `params` (by name)."""
    if trained is None:
        return
    if not isinstance(trained, dict) or set(trained) != set(params) or any(
            not isinstance(trained[n], torch.Tensor) or trained[n].shape != p.shape for n, p in params.items()):
        raise CheckpointError("the checkpoint's state.pt holds trained weights (--train.ema) that do not fit the "
                              "model's parameters; start again with --overwrite")
    for n, p in params.items():
        p.copy_(trained[n].to(p.device))


def averaged(average: WeightAverage | None):
    """A context in which the model holds its averaged weights (none without an average)."""
    return contextlib.nullcontext() if average is None else average.applied()

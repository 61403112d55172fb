"""Sampling with a static decode step, captured once as a CUDA graph and replayed per token (issue 48).

The eager decode step (`ImageTransformer.step`) takes the position as a Python int and launches
some 150 small kernels from Python per token; on a GPU the launches, not the arithmetic, set its
time. `StaticDecoder` holds everything one step touches at fixed addresses:
* the caches (imggen.decode.make_caches, stepped through imggen.decode.static: the slot and the read
  mask of position t computed on the device);
* the position t and the previous tokens as device tensors;
* the context features, the draws' uniforms (`imggen.sampling.uniforms`: the same streams as the
  eager sampler), the known tokens and their mask, indexed by t on the device;
* the tokens drawn and their log-likelihoods.
`step()` embeds, runs every layer, draws (temperature, top-k, known pixels forced) and advances t,
with no host sync and no Python branch on t (tests: "static_step"). On CUDA it is captured once per
(model, batch, cache, draw settings) and replayed; the first capture is checked against the eager
static step on a few positions and, if they differ, sampling goes on eagerly after one warning.

Runs of positions known for every image (prefill, extend) go through the eager caches between
replays, as in `imggen.sampling.sample`, so a sequence gets the same tokens either way.
May import what imggen.sampling may.
"""
from __future__ import annotations

import warnings

import torch

from imggen.decode import make_caches
from imggen.decode.panels import reference_linear
from imggen.decode.static import static_caches
from imggen.errors import ConfigError

GRAPH_MODES = ("auto", "on", "eager", "off")  # auto: a CUDA graph on CUDA, today's step elsewhere
CHECK_STEPS = 4  # positions the first capture is checked on
_CHECKED: dict = {}  # (model config, decoder key) -> whether graph replays matched the eager step
MAX_HELD = 2  # decoders kept per model (e.g. a batch and the last smaller chunk of `generate`)


def use_static(graph: str, device: torch.device) -> bool:
    """Whether `sample` takes the static step for `graph` (GRAPH_MODES) on `device`."""
    if graph not in GRAPH_MODES:
        raise ConfigError(f"graph={graph!r}: choose one of {', '.join(GRAPH_MODES)}")
    if graph == "on" and device.type != "cuda":
        raise ConfigError("graph='on' needs a CUDA device (a CUDA graph); use 'eager' for the static step elsewhere")
    return graph in ("on", "eager") or (graph == "auto" and device.type == "cuda")


class StaticDecoder:
    """The buffers and the step of one (model, batch, cache kind, draw settings)."""

    def __init__(self, model, batch: int, cache: str, temperature: float, top_k: int | None,
                 known: bool, context: bool, pick=None):
        cfg, p = model.config, next(model.parameters())
        dev, n = p.device, cfg.seq_len
        self.model, self.batch, self.temperature, self.top_k = model, batch, temperature, top_k
        # pick(logits, temperature, top_k, u) -> tokens: imggen.sampling's draw (passed in: it imports this module)
        self.pick = pick or (lambda logits, *_: logits.argmax(-1))
        self.caches = make_caches(model, batch, cache)  # eager views too: prefill / extend between steps
        self.static = static_caches(self.caches)
        self.t = torch.zeros(1, dtype=torch.long, device=dev)
        self.prev = torch.zeros(batch, dtype=torch.long, device=dev)
        self.tokens = torch.zeros(batch, n, dtype=torch.long, device=dev)
        self.logp = torch.zeros(batch, device=dev)
        self.logits = torch.zeros(batch, cfg.vocab, device=dev)
        self.draws = torch.zeros(batch, n, device=dev)
        self.known = torch.zeros(batch, n, dtype=torch.long, device=dev) if known else None
        self.known_mask = torch.zeros(batch, n, dtype=torch.bool, device=dev) if known else None
        self.feats = torch.zeros(batch, n, cfg.dim, device=dev, dtype=p.dtype) if context else None
        self.graph = None

    def load(self, draws, known=None, known_mask=None, feats=None) -> None:
        """A new run: empty caches, t = 0, the run's inputs copied into the held buffers."""
        for c in self.static:
            c.reset()
        for buf in (self.t, self.prev, self.tokens, self.logp):
            buf.zero_()
        self.draws.copy_(draws)
        for buf, new in ((self.known, known), (self.known_mask, known_mask), (self.feats, feats)):
            if buf is not None:
                buf.copy_(new)

    def seek(self, t: int) -> None:
        """Continue at position t (after a prefill or extend): t and the previous tokens on the device."""
        self.t.fill_(t)
        if t:
            self.prev.copy_(self.tokens[:, t - 1])

    # -- the step ---------------------------------------------------------------------------------
    def eager_step(self) -> None:
        """Position t: logits, the draw, the log-likelihood, t + 1; device work only."""
        t = self.t
        logits = self.forward(self.prev, t)
        nxt = self.pick(logits, self.temperature, self.top_k, self.draws.index_select(1, t)[:, 0])
        if self.known is not None:
            nxt = torch.where(self.known_mask.index_select(1, t)[:, 0], self.known.index_select(1, t)[:, 0], nxt)
        self.tokens.index_copy_(1, t, nxt[:, None])
        self.logp.add_(torch.log_softmax(logits, -1).gather(-1, nxt[:, None])[:, 0])
        self.logits.copy_(logits)
        self.prev.copy_(nxt)
        self.t.add_(1)

    def forward(self, prev, t) -> torch.Tensor:
        """Logits (B, V), float32, at position t (long (1,)) given tokens t-1 (`prev`; ignored at t = 0):
        ImageTransformer.step's arithmetic with the position on the device."""
        m = self.model
        x = torch.where(t[:, None] == 0, m.start.expand(self.batch, -1), m.tok_emb(prev))
        y, col, ch = m.pos_index.index_select(1, t)
        x = x + m.row_emb(y) + m.col_emb(col) + m.chan_emb(ch)
        if self.feats is not None:
            x = x + self.feats.index_select(1, t)[:, 0]
        for blk, cache in zip(m.blocks, self.static):  # Block.step, its cache stepped by the device position
            x = blk.step(x, t, cache, reference_linear)
        return m.to_logits(reference_linear(m.head, x, ln=m.ln_f).float())

    def step(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self.eager_step()

    def capture(self) -> None:
        """Record one step as a CUDA graph (after warm-up steps on a side stream: the kernels' first-use
        checks, cuBLAS workspaces). The warm-up changes the buffers: `load` before sampling."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.eager_step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.eager_step()
        self.graph = graph

    def matches_eager(self, draws, known=None, known_mask=None, feats=None, steps: int = CHECK_STEPS) -> bool:
        """Whether `steps` graph replays from t = 0 give the eager static step's tokens and logits."""
        runs = []
        for replay in (True, False):
            self.load(draws, known, known_mask, feats)
            out = []
            for _ in range(steps):
                self.graph.replay() if replay else self.eager_step()
                out.append(self.logits.clone())
            runs.append((torch.stack(out), self.tokens[:, :steps].clone()))
        (la, ta), (lb, tb) = runs
        return bool(torch.equal(ta, tb) and torch.allclose(la, lb, rtol=1e-3, atol=1e-3))


def decoder(model, batch: int, cache: str, temperature: float, top_k: int | None, known: bool, context: bool,
            graph: bool, draws, known_t=None, known_mask=None, feats=None, pick=None) -> StaticDecoder:
    """The held StaticDecoder of these settings (made, and on CUDA captured and checked, on first use),
    loaded with this run's inputs."""
    held = model.__dict__.setdefault("_static_decoders", {})
    p = next(model.parameters())  # a model moved or cast since has new weights: a new decoder
    key = (batch, cache, float(temperature), top_k, known, context, graph, p.device, p.dtype, p.data_ptr())
    dec = held.pop(key, None)
    if dec is None:
        dec = StaticDecoder(model, batch, cache, temperature, top_k, known, context, pick)
        if graph:
            dec.capture()
            ck = (repr(model.config), key)
            if ck not in _CHECKED:
                _CHECKED[ck] = dec.matches_eager(draws, known_t, known_mask, feats,
                                                 min(CHECK_STEPS, model.config.seq_len))
                if not _CHECKED[ck]:
                    warnings.warn("the CUDA graph of the decode step differs from the eager step on its first "
                                  "positions; sampling uses the eager step (--no-graph to skip the graph)",
                                  RuntimeWarning, stacklevel=3)
            if not _CHECKED[ck]:
                dec.graph = None
    held[key] = dec  # most recently used last
    while len(held) > MAX_HELD:
        held.pop(next(iter(held)))
    dec.load(draws, known_t, known_mask, feats)
    return dec

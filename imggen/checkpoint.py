"""Checkpoints: safetensors weights + JSON config + optimizer/RNG state, written atomically, verified when read.

Layout of a run directory:
    RUN/config.json                     the run's full config
    RUN/checkpoints/step_000200/        model.safetensors, config.json, state.pt, manifest.json
    RUN/checkpoints/LATEST              name of the newest complete checkpoint (replaced atomically)

A checkpoint folder is written under a temporary name and renamed when complete, then LATEST is
replaced: a kill while saving leaves the previous one loadable, and a reader (no lock) sees whole
checkpoints only (load_model resolves again if the run's cleanup removed the one it found).
manifest.json records each file's size and sha256; reading checks them (older checkpoints: as far as
their files allow). LATEST is a hint: missing, naming a removed or corrupt folder, the newest step_*
that verifies is used (one warning line on stderr names what was skipped).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import zipfile

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from imggen.config import Config, DataConfig
from imggen.errors import CheckpointError
from imggen.storage import atomic_write_text, writing

MANIFEST = "manifest.json"
REQUIRED = ("model.safetensors", "config.json")
_STEP = re.compile(r"step_\d+")
_warned: set[str] = set()


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_manifest(ckpt_dir: str) -> None:
    files = {}
    for name in sorted(os.listdir(ckpt_dir)):
        path = os.path.join(ckpt_dir, name)
        files[name] = {"size": os.path.getsize(path), "sha256": _sha256(path)}
    with open(os.path.join(ckpt_dir, MANIFEST), "w") as f:
        json.dump({"files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def save_checkpoint(run_dir: str, step: int, model, cfg: Config, state: dict | None = None, keep: int = 2,
                    notes: dict | None = None) -> str:
    """Write checkpoint `step` of run `run_dir` (atomically; float32 weights; `notes`, strings, into the
    safetensors metadata, e.g. the precision) and keep the newest `keep`. A write that fails for want of
    storage is a StorageError naming the file; its temporary folder is removed, earlier checkpoints kept."""
    ckpts = os.path.join(run_dir, "checkpoints")
    name = f"step_{step:07d}"
    final, tmp, where = os.path.join(ckpts, name), None, ckpts

    def remove_tmp():
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    with writing(lambda: where, remove_tmp):  # `where`: the file being written when a write fails
        os.makedirs(ckpts, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=ckpts, prefix=".tmp-")
        weights = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
        where = os.path.join(final, "model.safetensors")  # named as it will be; written in tmp
        save_file(weights, os.path.join(tmp, "model.safetensors"), metadata={"step": str(step), **(notes or {})})
        where = os.path.join(final, "config.json")
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write(cfg.to_json())
        if state is not None:
            where = os.path.join(final, "state.pt")
            with open(os.path.join(tmp, "state.pt"), "wb") as f:  # our file object: a full disk is its OSError
                torch.save(state, f)
        where = os.path.join(final, MANIFEST)
        _write_manifest(tmp)
        where = final
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        tmp = None
    atomic_write_text(os.path.join(ckpts, "LATEST"), name)
    # keep the newest `keep`; a folder with a higher step is left from a run this one overwrote; a .tmp-
    # folder is a save cut short by kill -9 (a run folder has one writer: this process holds its lock)
    others = [d for d in os.listdir(ckpts) if _STEP.fullmatch(d) and d != name]
    older = sorted(d for d in others if _step(d) < step)
    stale = [d for d in others if _step(d) > step] + [d for d in os.listdir(ckpts) if d.startswith(".tmp-")]
    for d in stale + older[: max(0, len(older) - (keep - 1))]:  # a .tmp- file: LATEST's write cut short
        path = os.path.join(ckpts, d)
        shutil.rmtree(path, ignore_errors=True) if os.path.isdir(path) else os.remove(path)
    return final


def set_aside(ckpt_dir: str) -> tuple[str, str | None]:
    """Rename checkpoint `ckpt_dir` (found unusable after it was written) to `<name>.diverged`, which
    no search picks, and point LATEST at the newest intact checkpoint left (or remove it when none is).
    Returns (the new path, that checkpoint or None)."""
    ckpts = os.path.dirname(ckpt_dir)
    aside = ckpt_dir + ".diverged"
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(ckpt_dir, aside)
    latest, _ = _search(os.path.dirname(ckpts))
    pointer = os.path.join(ckpts, "LATEST")
    if latest:
        atomic_write_text(pointer, os.path.basename(latest))
    elif os.path.exists(pointer):
        os.remove(pointer)
    return aside, latest


def _step(name: str) -> int:
    return int(name.split("_", 1)[1])


def step_of(ckpt_dir: str) -> int:
    """The step of checkpoint folder `ckpt_dir` (RUN/checkpoints/step_0000200 -> 200)."""
    return _step(os.path.basename(ckpt_dir))


def verify(ckpt_dir: str, files=None) -> str | None:
    """None when checkpoint directory `ckpt_dir` is intact, else why not (one line).

    With a manifest: every listed file (or only `files`) must have its recorded size and sha256.
    Without one (older checkpoints): the safetensors header must parse and cover the file, the
    config must be JSON, and state.pt (when present) must pass its zip CRC checks.
    """
    manifest = os.path.join(ckpt_dir, MANIFEST)
    if os.path.isfile(manifest):
        try:
            with open(manifest) as f:
                listed = json.load(f)["files"]
            sizes = {n: int(m["size"]) for n, m in listed.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return f"{MANIFEST} is unreadable ({type(e).__name__})"
        for name in REQUIRED:
            if name not in listed:
                return f"{MANIFEST} does not list {name}"
        for name in (files or listed):
            if name not in listed:
                continue
            path = os.path.join(ckpt_dir, name)
            if not os.path.isfile(path):
                return f"{name} is missing"
            if os.path.getsize(path) != sizes[name]:
                return f"{name} has {os.path.getsize(path)} bytes, {MANIFEST} says {sizes[name]}"
            if _sha256(path) != listed[name]["sha256"]:
                return f"{name} does not match its sha256 in {MANIFEST}"
        return None
    check = set(files or (*REQUIRED, "state.pt"))
    for name in REQUIRED:
        if name in check and not os.path.isfile(os.path.join(ckpt_dir, name)):
            return f"{name} is missing"
    if "model.safetensors" in check:
        try:
            with safe_open(os.path.join(ckpt_dir, "model.safetensors"), "pt"):
                pass
        except Exception as e:  # noqa: BLE001 - safetensors raises several types on corrupt files
            return f"model.safetensors is unreadable ({e})"
    if "config.json" in check:
        try:
            with open(os.path.join(ckpt_dir, "config.json")) as f:
                json.load(f)
        except (OSError, ValueError) as e:
            return f"config.json is unreadable ({e})"
    state = os.path.join(ckpt_dir, "state.pt")
    if "state.pt" in check and os.path.exists(state):
        try:
            with zipfile.ZipFile(state) as z:
                bad = z.testzip()
        except (OSError, zipfile.BadZipFile, EOFError) as e:
            return f"state.pt is unreadable ({e})"
        if bad is not None:
            return f"state.pt is corrupt (member {bad} fails its CRC)"
    return None


def _warn_once(msg: str) -> None:
    if msg not in _warned:  # resolve() may run several times on one run
        _warned.add(msg)
        print(f"warning: {msg}", file=sys.stderr, flush=True)


def _read_latest(ckpts: str) -> str | None:
    try:
        with open(os.path.join(ckpts, "LATEST")) as f:
            return f.read(256).strip()
    except (OSError, UnicodeDecodeError):
        return None


def _search(run_dir: str) -> tuple[str | None, list[str]]:
    """(newest intact checkpoint dir or None, notes on what was skipped)."""
    ckpts = os.path.join(run_dir, "checkpoints")
    if not os.path.isdir(ckpts):
        return None, []
    steps = sorted((d for d in os.listdir(ckpts) if _STEP.fullmatch(d) and os.path.isdir(os.path.join(ckpts, d))),
                   key=_step, reverse=True)
    hint, notes = _read_latest(ckpts), []
    if hint is not None and hint not in steps:
        notes.append(f"LATEST names {hint[:40]!r}, which is not a checkpoint folder")
    for name in ([hint] if hint in steps else []) + [d for d in steps if d != hint]:
        why = verify(os.path.join(ckpts, name))
        if why is None:
            return os.path.join(ckpts, name), notes
        notes.append(f"{name} is corrupt: {why}")
    return None, notes


def find_checkpoint(run_dir: str) -> str | None:
    """The newest intact checkpoint directory of run `run_dir`, or None when it has none.

    LATEST is tried first, then the step_* folders newest first; skipping anything prints one
    warning line on stderr.
    """
    found, notes = _search(run_dir)
    _warn_skipped(run_dir, found, notes)
    return found


def _warn_skipped(run_dir: str, found: str | None, notes: list[str]) -> None:
    if notes:
        _warn_once(f"checkpoints in {os.path.join(run_dir, 'checkpoints')}: " + "; ".join(notes)
                   + (f"; using {os.path.basename(found)}" if found else "; no intact checkpoint left"))


ACCEPTS = ("a run directory written by train.py (e.g. runs/demo), its checkpoints folder or LATEST file, "
           "or one of its checkpoints/step_* folders (or the model.safetensors in one)")


def resolve(path) -> str:
    """A run dir, its `checkpoints` folder or LATEST file, a checkpoint dir or a file in one (its
    model.safetensors, config.json) -> an intact checkpoint dir: a run's newest (LATEST first,
    `find_checkpoint`); a checkpoint dir named directly must verify. Anything else is a CheckpointError
    naming the path given and what is accepted."""
    if not isinstance(path, (str, os.PathLike)) or not isinstance(os.fspath(path), str):
        raise CheckpointError(f"checkpoint path must be a str or os.PathLike, got {path!r} "
                              f"({type(path).__name__}); pass {ACCEPTS}")
    given = path = os.fspath(path)
    if not path:
        raise CheckpointError(f"checkpoint path is empty; pass {ACCEPTS}")
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint {path} does not exist; pass {ACCEPTS}")
    if os.path.isfile(path):
        name, folder = os.path.basename(path), os.path.dirname(os.path.abspath(path))
        if name == "LATEST" and os.path.basename(folder) == "checkpoints":
            path = os.path.dirname(folder)  # the run: LATEST first, then the newest intact step_*
        elif name in ("model.safetensors", "config.json", "state.pt", MANIFEST):
            path = folder  # a file of a checkpoint (or the run's config.json)
        else:
            raise CheckpointError(f"checkpoint {given} is a file, not a run or checkpoint folder; pass {ACCEPTS}")
    elif os.path.basename(os.path.abspath(path)) == "checkpoints" and not any(
            os.path.exists(os.path.join(path, name)) for name in ("checkpoints", "model.safetensors")):
        path = os.path.dirname(os.path.abspath(path))  # RUN/checkpoints -> RUN
    if os.path.isdir(os.path.join(path, "checkpoints")):
        found, notes = _search(path)
        if found is None:
            raise CheckpointError(f"no intact checkpoint under {os.path.join(path, 'checkpoints')}"
                                  + (": " + "; ".join(notes) if notes else "; has this run saved one yet?")
                                  + "; train again with --overwrite or pass another run")
        _warn_skipped(path, found, notes)
        return found
    if not os.path.exists(os.path.join(path, "model.safetensors")):
        what = f"{given} (from {path})" if os.path.abspath(given) != os.path.abspath(path) else given
        raise CheckpointError(f"no model.safetensors under {what} and no checkpoints folder: neither a checkpoint "
                              f"nor a run that has saved one yet; pass {ACCEPTS}")
    why = verify(path)
    if why is not None:
        raise CheckpointError(f"checkpoint {path} is corrupt: {why}; pass its run directory to fall back to "
                              f"the newest intact checkpoint")
    return path


def read_config(ckpt_dir: str) -> Config:
    """The validated config of checkpoint `ckpt_dir`; a CheckpointError naming its config.json otherwise."""
    path = os.path.join(ckpt_dir, "config.json")
    try:
        with open(path) as f:
            return Config.from_dict(json.load(f)).validate()
    except (OSError, ValueError) as e:  # ValueError: bad JSON or text, and ConfigError
        raise CheckpointError(f"cannot read the config of checkpoint {path}: {e}") from None


def config_diff(a: Config, b: Config, section: str = "model") -> list[str]:
    da, db, how_read = a.to_dict()[section], b.to_dict()[section], DataConfig.HOW_READ if section == "data" else ()
    return [f"{section}.{k}: checkpoint {da.get(k)!r} vs requested {db.get(k)!r}"
            for k in sorted(set(da) | set(db)) if da.get(k) != db.get(k) and k not in how_read]


def load_weights(model, ckpt_dir: str, cfg: Config | None = None) -> None:
    """Load weights into `model`; a checkpoint from another model config is a CheckpointError."""
    why = verify(ckpt_dir, files=REQUIRED)
    if why is not None:
        raise CheckpointError(f"checkpoint {ckpt_dir} is corrupt: {why}")
    saved = read_config(ckpt_dir)
    if cfg is not None:
        diff = config_diff(saved, cfg)
        if diff:
            raise CheckpointError(f"checkpoint {ckpt_dir} was trained with another model config:\n  "
                                  + "\n  ".join(diff) + "\nuse the same --model.* settings or a new --out")
    try:
        weights = load_file(os.path.join(ckpt_dir, "model.safetensors"))
    except Exception as e:  # safetensors raises several types on corrupt files
        raise CheckpointError(f"cannot read {ckpt_dir}/model.safetensors: {e}") from None
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {ckpt_dir} does not fit this model: missing {missing}, "
                              f"unexpected {unexpected}")


def read_notes(ckpt_dir: str) -> dict:
    """The notes save_checkpoint wrote into the weights' metadata (the step, the precision)."""
    with safe_open(os.path.join(ckpt_dir, "model.safetensors"), "pt") as f:
        return dict(f.metadata() or {})


def load_state(ckpt_dir: str, map_location=None) -> dict:
    """The training state (optimizer, RNG, step) of checkpoint `ckpt_dir`, for --resume; verified first."""
    path = os.path.join(ckpt_dir, "state.pt")
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {ckpt_dir} has no state.pt (saved without training state); "
                              f"it can be loaded as a model but not resumed")
    why = verify(ckpt_dir, files=("state.pt",))
    if why is not None:
        raise CheckpointError(f"checkpoint {ckpt_dir} is corrupt: {why}")
    try:  # weights_only: tensors and plain containers only; no object in the file can run code
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - pickle and torch raise several types on refused or corrupt data
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"{path} holds more than training state (tensors, numbers and plain containers), "
                              f"so it was not loaded: {first[:200]}; resume only runs you trust to have "
                              f"written it, or start again with --overwrite") from None
    why = _state_problem(state)
    if why is not None:
        raise CheckpointError(f"{path} is not imggen training state: {why}; start again with --overwrite")
    return state


def _state_problem(state) -> str | None:
    """None when `state` has save()'s layout: optimizer state dict, CPU RNG state, step (and trained)."""
    if not isinstance(state, dict) or set(state) - {"trained"} != {"optimizer", "rng", "step"}:
        keys = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        return f"expected the keys optimizer, rng and step (and trained), found {keys}"
    if not (isinstance(state["step"], int) and state["step"] >= 0):
        return f"step must be a non-negative int, got {state['step']!r}"
    rng = state["rng"]
    if not (isinstance(rng, torch.Tensor) and rng.dtype == torch.uint8 and rng.dim() == 1):
        return "rng is not a CPU generator state (a 1-D uint8 tensor)"
    opt = state["optimizer"]
    if not (isinstance(opt, dict) and isinstance(opt.get("state"), dict) and isinstance(opt.get("param_groups"), list)):
        return "optimizer is not an optimizer state dict (state and param_groups)"
    return None


def check_fits(ckpt_dir: str, cfg: Config) -> None:
    """CheckpointError unless the model `cfg` describes has exactly the tensors of the checkpoint's
    model.safetensors (names and shapes, read from its header). Checked on the meta device, so a
    config that names an absurd model (height 10**9) fails here, before any memory is allocated:
    what a model built from a checkpoint allocates is bounded by its weights file."""
    from imggen.model import ImageTransformer

    try:
        with safe_open(os.path.join(ckpt_dir, "model.safetensors"), "pt") as f:
            saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:  # noqa: BLE001 - safetensors raises several types on corrupt files
        raise CheckpointError(f"cannot read {ckpt_dir}/model.safetensors: {e}") from None
    with torch.device("meta"):
        wanted = {k: tuple(v.shape) for k, v in ImageTransformer(cfg.model).state_dict().items()}
    if saved != wanted:
        diff = sorted(k for k in set(saved) | set(wanted) if saved.get(k) != wanted.get(k))
        show = ", ".join(f"{k}: file {saved.get(k)} vs config {wanted.get(k)}" for k in diff[:3])
        raise CheckpointError(f"checkpoint {ckpt_dir}: config.json and model.safetensors do not belong together "
                              f"({len(diff)} tensors differ: {show}); restore the checkpoint's own files")


def load_model(path, device: str | torch.device = "cpu", backend: str | None = None):
    """Restore a model (config + weights) from a run dir, its checkpoints folder or LATEST file, a
    checkpoint dir or its model.safetensors (`resolve`); anything else is a CheckpointError."""
    from imggen.model import ImageTransformer

    for again in (True, True, False):  # a run's cleanup (keep=2) may remove the checkpoint just resolved
        ckpt = resolve(path)
        try:
            cfg = read_config(ckpt)
            cfg.model.backend = backend or cfg.model.backend
            check_fits(ckpt, cfg)
            model = ImageTransformer(cfg.model)
            load_weights(model, ckpt)
            return model.to(device).eval()
        except CheckpointError:
            if not again:
                raise

"""The evaluation report of a run directory: RUN/report/{report.json, report.md, samples.png,
curves.png, inpainting.png}, assembled from the metric runners (imggen.eval.runners)."""
from __future__ import annotations

import json
import math
import os
import shutil
import time
import warnings

import numpy as np

from imggen.errors import DataError
from imggen.eval.run import limit_note, load_data, load_run, read_log, split_images, write_json
from imggen.eval.runners import osra_available, run_atoms, run_bpd, run_fid, run_inpaint, sample_images
from imggen.images import image_scale


def atoms_table(res: dict) -> str:
    keys = res.get("keys") or list(res["generated"])
    rows = ["| metric | generated | ceiling (true drawings) | generated / ceiling |", "|---|---|---|---|"]
    f = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
    for k in keys:
        if k in res["generated"] or k in res["ceiling"]:
            rows.append(f"| {k} | {f(res['generated'].get(k))} | {f(res['ceiling'].get(k))} | "
                        f"{f(res['ratio'].get(k))} |")
    return "\n".join(rows)


def plot_curves(log: list[dict], path: str, title: str = "") -> str:
    """Training / validation (and test) bits/dim vs step -> PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=100)
    for key, style in (("train_bpd", "-"), ("val_bpd", "o-"), ("test_bpd", "*")):
        pts = [(r["step"], r[key]) for r in log if key in r and r[key] is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, style, label=key.replace("_bpd", ""), markersize=6 if key != "train_bpd" else 2)
    if not log:
        ax.text(0.5, 0.5, "no log.jsonl entries", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("step")
    ax.set_ylabel("bits/dim")
    ax.set_title(title or "bits/dim during training")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, format="png")
    plt.close(fig)
    return path


def _fmt(v, nd=3):
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{nd}f}" if math.isfinite(v) else str(v)
    return str(v)


def make_report(path: str, out: str | None = None, num: int = 16, seed: int = 0, device: str = "cpu",
                spec: str | None = None, split: str = "test", limit: int | None = None, bootstrap: int = 1000,
                inpaint_num: int = 4, atoms: str = "auto", fid_weights: str | None = None,
                batch_size: int = 16) -> dict:
    """Evaluate a run directory and write report.json, report.md and PNGs under `out`."""
    from imggen.images import save_grid

    if fid_weights:
        from imggen.eval.fid import _resolve_weights
        _resolve_weights(fid_weights)  # fail before loading and sampling when the weights are missing
    run = load_run(path, device)
    cfg, m = run.cfg, run.cfg.model
    # data: data named with `spec` (--data) must load; the run's own data may be missing (bits/dim is then
    # skipped with a note and the rest of the report is still written)
    data, data_note = None, None
    try:
        data = load_data(cfg, spec)
    except DataError as e:
        if spec is not None:
            raise
        data_note = f"evaluation data unavailable: {e}"
    base = run.run_dir or os.path.dirname(os.path.dirname(os.path.abspath(run.ckpt)))
    out = out or os.path.join(base, "report")
    os.makedirs(out, exist_ok=True)
    spec = spec or cfg.data.spec
    rep: dict = {"checkpoint": run.ckpt, "run_dir": run.run_dir, "step": run.step, "data": spec,
                 "created": time.strftime("%Y-%m-%d %H:%M:%S"), "files": {}, "notes": [data_note] if data_note else []}
    n_params = sum(p.numel() for p in run.model.parameters())
    rep["config"] = {"preset": cfg.preset, "data": cfg.data.spec, "shape": list(m.shape), "bits": m.bits,
                     "dim": m.dim, "layers": m.layers, "heads": m.heads, "attention": m.attention,
                     "params": n_params, "train_steps": cfg.train.steps, "batch_size": cfg.train.batch_size,
                     "lr": cfg.train.lr}
    metrics = {}
    if run.run_dir and os.path.exists(os.path.join(run.run_dir, "metrics.json")):
        with open(os.path.join(run.run_dir, "metrics.json")) as f:
            metrics = json.load(f)
    rep["train_metrics"] = metrics
    rep["unigram_bpd"] = metrics.get("unigram_bpd")
    log = read_log(run.run_dir)
    tps = [r["tokens_per_s"] for r in log if "tokens_per_s" in r]
    rep["training"] = {"tokens_per_s_median": float(np.median(tps)) if tps else None,
                       "last_train_bpd": next((r["train_bpd"] for r in reversed(log) if "train_bpd" in r), None),
                       "last_val_bpd": next((r["val_bpd"] for r in reversed(log) if "val_bpd" in r), None)}

    # bits/dim
    rep["bpd"] = None
    if data is not None:
        r = run_bpd(run, data, spec, split, limit, bootstrap, batch_size, seed)
        r.pop("per_image", None)
        note = limit_note(limit, r["n_images"], f"images of the {split} split", "bits/dim over")
        if note:
            rep["notes"].append(note)
        rep["bpd"] = r

    # samples + speed (an inpainting model draws only given a context: its fills are the inpainting section)
    imgs, rep["sampling"] = None, None
    if run.model.context is None:
        imgs, rep["sampling"] = sample_images(run, num, seed=seed, batch_size=batch_size)
        sp = os.path.join(out, "samples.png")
        save_grid(imgs, sp, scale=image_scale(m.width))
        rep["files"]["samples"] = sp
    else:
        rep["notes"].append("no unconditional samples, atom-bond accuracy or FID: this model was trained for "
                            "inpainting and draws only given known pixels (its fills: the Inpainting section, "
                            "on data with masks such as brats-demo; bits/dim: of the unknown pixels)")

    # curves
    cp = plot_curves(log, os.path.join(out, "curves.png"), title=f"{cfg.preset}: {cfg.data.spec}")
    rep["files"]["curves"] = cp

    # inpainting (datasets with masks)
    rep["inpainting"] = None
    if data is not None and data.masks.get(split) is not None and inpaint_num > 0:
        try:
            r = run_inpaint(run, data, spec, split, inpaint_num, seed=seed, out=os.path.join(out, "inpainting"),
                            batch_size=batch_size)
            r.pop("_arrays", None)
            shutil.copyfile(r["files"]["grid"], os.path.join(out, "inpainting.png"))
            rep["files"]["inpainting"] = os.path.join(out, "inpainting.png")
            rep["inpainting"] = {k: v for k, v in r.items() if k not in ("per_image", "files", "json")}
        except DataError as e:
            rep["notes"].append(f"inpainting skipped: {e}")

    # atoms (molecules, when OSRA is installed)
    rep["atoms"], rep["atoms_note"] = None, None
    is_mol = spec.split(":")[0] == "molecules"
    if is_mol and atoms != "off" and imgs is not None:
        from imggen.eval.atoms import readable_note
        rep["atoms_note"] = readable_note(m.height, m.width)  # too small for OSRA: one line, not a table of zeros
        if rep["atoms_note"] is None:
            if not osra_available():
                rep["notes"].append("atoms skipped: `osra` is not on PATH (apt-get install osra)")
            elif data is not None:
                try:
                    rep["atoms"] = run_atoms(run, num, seed, num_ref=num, spec=spec, data=data, images=imgs)
                except Exception as e:  # noqa: BLE001 - OSRA/RDKit failures must not sink the report
                    rep["notes"].append(f"atoms failed: {type(e).__name__}: {e}")

    # FID (only when weights are given: the network is slow on CPU and few samples bias it)
    rep["fid"] = None
    if fid_weights and imgs is not None:
        if data is None:
            rep["notes"].append("FID skipped: no reference data")
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                rep["fid"] = run_fid(imgs, split_images(data, split, limit), fid_weights, device)
    rep["report_md"] = os.path.join(out, "report.md")
    write_json(rep, os.path.join(out, "report.json"))
    with open(os.path.join(out, "report.md"), "w") as f:
        f.write(report_markdown(rep))
    rep["report_json"] = os.path.join(out, "report.json")
    return rep


def report_markdown(rep: dict) -> str:
    c = rep["config"]
    L = [f"# Evaluation report: {rep['run_dir'] or rep['checkpoint']}", "",
         f"checkpoint `{rep['checkpoint']}` (step {rep['step']}), data `{rep['data']}`, {rep['created']}", "",
         "## Config", "", "| setting | value |", "|---|---|"]
    for k in ("preset", "data", "shape", "bits", "dim", "layers", "heads", "attention", "params",
              "train_steps", "batch_size", "lr"):
        v = c.get(k)
        L.append(f"| {k} | {'x'.join(map(str, v)) if k == 'shape' else _fmt(v, 6) if isinstance(v, float) else v} |")
    L += ["", "## Bits/dim", "", "| quantity | bits/dim | note |", "|---|---|---|"]
    b = rep.get("bpd")
    if b:
        ci = b.get("ci95")
        ci_s = f" (95% CI {ci[0]:.3f} - {ci[1]:.3f}, {b['bootstrap']} bootstrap resamples)" if ci else ""
        L.append(f"| {b['split']} ({b['n_images']} images) | {b['bpd']:.3f}{ci_s} | {b['label']} |")
    else:
        L.append("| test | n/a | evaluation data unavailable |")
    tm = rep.get("train_metrics") or {}
    if tm.get("test_bpd") is not None:
        L.append(f"| test, at end of training (metrics.json) | {_fmt(tm['test_bpd'])} | |")
    if rep.get("unigram_bpd") is not None:
        L.append(f"| unigram baseline (entropy of training token values) | {_fmt(rep['unigram_bpd'])} | "
                 f"a model that ignores context: a useful model is below this |")
    tr = rep.get("training") or {}
    if tr.get("last_val_bpd") is not None:
        L.append(f"| last validation (log.jsonl) | {_fmt(tr['last_val_bpd'])} | |")
    s = rep["sampling"]
    L += ["", "## Speed", "", "| quantity | value |", "|---|---|"]
    if s:
        L.append(f"| sampling ({s['num']} images, {s['device']}) | {s['tokens_per_s']:.0f} tokens/s, "
                 f"{s['seconds']:.2f} s total, {s['images_per_s']:.3f} images/s |")
    if tr.get("tokens_per_s_median") is not None:
        L.append(f"| training (median of log.jsonl) | {tr['tokens_per_s_median']:.0f} tokens/s |")
    ip = rep.get("inpainting")
    if ip:
        L += ["", "## Inpainting", "", f"{ip['n_images']} {ip['split']} images, rank {ip['rank']}. {ip['protocol']}.",
              "", "| region | PSNR (dB) | SSIM |", "|---|---|---|",
              f"| whole image | {_fmt(ip['psnr'], 2)} | {_fmt(ip['ssim'])} |",
              f"| inside mask | {_fmt(ip['psnr_mask'], 2)} | {_fmt(ip['ssim_mask'])} |",
              "", "![inpainting](inpainting.png)"]
    at = rep.get("atoms")
    if rep.get("atoms_note"):
        L += ["", "## Molecules: atom-bond accuracy (OSRA)", "", f"Not measured: {rep['atoms_note']}."]
    if at:
        L += ["", "## Molecules: atom-bond accuracy (OSRA)", "",
              f"{at['num']} generated images vs the ceiling on {at['num_ref']} true test drawings "
              f"(unpaired: exact_match needs paired references).", "", atoms_table(at)]
    fd = rep.get("fid")
    if fd:
        L += ["", "## FID", "", f"FID {fd['fid']:.2f} ({fd['n_a']} samples vs {fd['n_b']} reference images; "
              f"{fd['note']})"]
    L += ["", "## Figures", ""] + (["![samples](samples.png)", ""] if s else []) + ["![curves](curves.png)"]
    if rep.get("notes"):
        L += ["", "## Notes", ""] + [f"- {n}" for n in rep["notes"]]
    return "\n".join(L) + "\n"

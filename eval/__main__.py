"""`python -m imggen.eval bpd|inpaint|fid|atoms|molecules|report|brats ...` (console script: imggen-eval).

Every subcommand prints a short human summary; --json (bpd, fid, atoms) or the output folder
(inpaint, report) holds the full results. A bad flag or value is one line on stderr, exit code 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

import torch

from imggen.cli import (Parser, add_fill_flags, add_threads_flag, check_fill_args, device_arg, fill_args, int_at_least,
                        positive_int)
from imggen.errors import ConfigError, ImggenError

PROG = "python -m imggen.eval"


_nonneg_int = int_at_least(0, "an integer >= 0")


def _resamples(s: str) -> int:
    """--bootstrap: 0 (no CI) or at least 2 resamples."""
    n = _nonneg_int(s)
    if n == 1:
        raise argparse.ArgumentTypeError("1 resample gives no interval; use 0 (no CI) or >= 2 (e.g. 1000)")
    return n


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog=PROG, description="Evaluate imggen models: bits/dim, inpainting, FID, atom-bond "
                                        "accuracy, and a full report of a run directory.")
    sub = ap.add_subparsers(dest="cmd", metavar="SUBCOMMAND", parser_class=Parser,
                            help="bpd | inpaint | fid | atoms | molecules | report | brats | realism (each has --help)")
    sub.required = True
    dev = "cuda" if torch.cuda.is_available() else "cpu"

    def common(p, data=True, split=True):
        p.add_argument("--checkpoint", required=True, metavar="RUN",
                       help="run directory written by train.py (or one of its checkpoints/step_* folders)")
        if data:
            p.add_argument("--data", metavar="SPEC",
                           help="evaluation data KIND[:PATH] (default: the run's config data.spec)")
        if split:
            p.add_argument("--split", default="test", choices=["train", "val", "test"],
                           help="data split to evaluate (default test)")
        p.add_argument("--device", type=device_arg, default=dev, help=f"torch device (default {dev})")
        p.add_argument("--batch-size", type=positive_int, default=16, help="images per forward / sampling batch (default 16)")
        add_threads_flag(p)

    p = sub.add_parser("bpd", help="exact test bits/dim with a bootstrap confidence interval",
                       description="Exact bits/dim of a checkpoint on a data split, with a percentile "
                                   "bootstrap 95% CI over images and a label saying what it is comparable with.")
    common(p)
    p.add_argument("--limit", type=positive_int, help="evaluate only the first N images of the split")
    p.add_argument("--bootstrap", type=_resamples, default=1000, help="bootstrap resamples for the CI (0: none; default 1000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the bootstrap resampling (default 0)")
    p.add_argument("--json", metavar="OUT", help="also write the full result (per-image values included) to this JSON file")

    p = sub.add_parser("inpaint", help="fill the masked region of BraTS slices; PSNR/SSIM + triplet PNGs",
                       description="Inpaint the masked regions of a dataset with masks (brats, brats-demo), "
                                   "score PSNR/SSIM over the whole image and inside the mask, write "
                                   "original/masked/filled triplet PNGs and inpaint.json.")
    common(p)
    p.add_argument("--limit", type=positive_int, help="inpaint the first N images with a non-empty mask (default 16)")
    p.add_argument("--rank", type=positive_int, default=1, help="candidates per image; keep the most likely (default 1)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    add_fill_flags(p)
    p.add_argument("--out", metavar="DIR", help="output folder (default RUN/inpaint)")

    p = sub.add_parser("fid", help="Frechet Inception Distance between two image sets (or samples vs test data)",
                       description="FID with pytorch-fid's Inception weights, between --images-a and --images-b, "
                                   "or between --num samples of --checkpoint and its data's test split.")
    p.add_argument("--images-a", metavar="A", help="uint8 images: .npz (key 'images', or its only array) or a folder of PNGs")
    p.add_argument("--images-b", metavar="B", help="second image set (.npz or folder); default with --checkpoint: the test split")
    p.add_argument("--checkpoint", metavar="RUN", help="sample --num images from this run as set A")
    p.add_argument("--num", type=int_at_least(2, "an integer >= 2 (FID needs a covariance)"), default=2048,
                   help="samples to draw with --checkpoint, at least 2 (default 2048)")
    p.add_argument("--data", metavar="SPEC", help="reference data with --checkpoint (default: the run's data.spec)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--weights", "--fid-weights", dest="weights", metavar="PATH",
                   help="pt_inception-2015-12-05-6726825d.pth (default: $IMGGEN_FID_WEIGHTS)")
    p.add_argument("--random-init", action="store_true",
                   help="testing only: random Inception weights (the number is not an FID)")
    p.add_argument("--device", type=device_arg, default=dev, help=f"torch device (default {dev})")
    p.add_argument("--batch-size", type=positive_int, default=50, help="images per Inception / sampling batch (default 50)")
    p.add_argument("--json", metavar="OUT", help="also write the result to this JSON file")

    p = sub.add_parser("atoms", help="atom-bond accuracy of sampled molecules (OSRA) vs the calibration ceiling",
                       description="Sample --num molecule images and read them back with OSRA; compare with the "
                                   "same metrics on true drawings of test-split SMILES (the ceiling). "
                                   "With --calibrate, only the ceiling for --data at --size.")
    p.add_argument("--checkpoint", metavar="RUN", help="molecule run directory to sample from")
    p.add_argument("--calibrate", action="store_true", help="only score true drawings of --data at --size (no model)")
    p.add_argument("--data", metavar="SPEC", help="molecule data (default: the run's data.spec; 'molecules' with --calibrate)")
    p.add_argument("--size", type=positive_int, default=128, help="image side for --calibrate (default 128)")
    p.add_argument("--num", type=positive_int, default=16, help="images to sample / SMILES to calibrate on (default 16)")
    p.add_argument("--num-ref", type=positive_int, help="reference test SMILES for the ceiling (default --num)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--device", type=device_arg, default=dev, help=f"torch device (default {dev})")
    p.add_argument("--batch-size", type=positive_int, default=16, help="sampling batch size (default 16)")
    p.add_argument("--json", metavar="OUT", help="also write the result to this JSON file")

    p = sub.add_parser("molecules", help="read drawings back with OSRA and score them like a molecule generator (MOSES)",
                       description="Read every drawing back with OSRA and report MOSES's metrics (validity, unique, "
                                   "novelty vs MOSES train, IntDiv, SNN/Frag/Scaf vs MOSES test) and the atom-bond "
                                   "accuracy, beside the ceiling of true drawings (--ceiling) and MOSES's baselines. "
                                   "Needs the MOSES data files: pip install --no-deps molsets==0.3.1")
    p.add_argument("--checkpoint", metavar="RUN", help="molecule run directory: sample --num drawings from it")
    p.add_argument("--images", metavar="DIR", help="score the PNG drawings of this folder instead")
    p.add_argument("--num", type=positive_int, default=16, help="drawings to sample with --checkpoint (default 16)")
    p.add_argument("--ceiling", type=_nonneg_int, default=0,
                   help="also read back true drawings of the first N drawable MOSES test molecules in the same "
                        "style (0: none; default 0)")
    p.add_argument("--k", type=positive_int, default=10000, help="unique@k over the first k valid molecules (default 10000)")
    p.add_argument("--ref-num", type=_nonneg_int, default=10000,
                   help="MOSES test molecules for SNN/Frag/Scaf (0: all 176,074; default 10000, cached after the first run)")
    p.add_argument("--out", metavar="DIR", help="folder for readback.png and readback.log "
                                                "(default RUN/molecules, or DIR-readback beside --images DIR)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    p.add_argument("--device", type=device_arg, default=dev, help=f"torch device (default {dev})")
    p.add_argument("--batch-size", type=positive_int, default=16, help="sampling batch size (default 16)")
    p.add_argument("--json", metavar="OUT", help="also write the result to this JSON file")

    p = sub.add_parser("report", help="evaluate a run directory -> report.json, report.md and PNGs",
                       description="Evaluate a run directory: config summary, test bits/dim with CI, unigram "
                                   "baseline, sampling speed, inpainting (data with masks), atoms (molecules, "
                                   "when osra is installed), FID (only with --fid-weights); writes report.json, "
                                   "report.md, samples.png, curves.png and inpainting.png.")
    common(p)
    p.add_argument("--num", type=positive_int, default=16, help="images to sample for the grid, speed and atoms (default 16)")
    p.add_argument("--limit", type=positive_int, help="bits/dim on the first N images of the split only")
    p.add_argument("--bootstrap", type=_resamples, default=1000, help="bootstrap resamples for the bits/dim CI (0: none; default 1000)")
    p.add_argument("--inpaint-num", type=_nonneg_int, default=4, help="images to inpaint when the data has masks (0: skip; default 4)")
    p.add_argument("--atoms", choices=["auto", "off"], default="auto",
                   help="atom-bond accuracy for molecule runs: auto (when osra is on PATH) or off")
    p.add_argument("--fid-weights", metavar="PATH", help="compute FID of the samples vs the split with these Inception weights")
    p.add_argument("--seed", type=int, default=0, help="sampling / bootstrap seed (default 0)")
    p.add_argument("--out", metavar="DIR", help="output folder (default RUN/report)")

    p = sub.add_parser("brats", help="score sample.py --brats volumes like the BraTS inpainting organisers",
                       description="Score every case folder of --data that has <case>-t1n and <case>-mask-healthy "
                                   "and a prediction --pred/<case>-t1n-inference.nii.gz with the organisers' "
                                   "SSIM / PSNR / MSE inside the healthy mask; writes a per-case CSV and prints "
                                   "the mean of each metric with a 95%% bootstrap interval over cases.")
    p.add_argument("--pred", required=True, metavar="PRED", help="folder of <case>-t1n-inference.nii.gz volumes")
    p.add_argument("--data", required=True, metavar="CASES", help="folder of case folders with -t1n, -mask-healthy")
    p.add_argument("--csv", metavar="PATH", help="per-case scores (default PRED/brats_scores.csv)")
    p.add_argument("--slice-axis", type=int, choices=(0, 1, 2), default=0,
                   help="array axis across the SSIM planes: 0 (default) = the organisers' sagittal planes; 2 = "
                        "axial planes, for slabs thinner than the 11-voxel SSIM window")
    p.add_argument("--json", metavar="OUT", help="also write the full result (per-case values included) to this JSON file")

    p = sub.add_parser("realism", help="how real grey 28x28 images look, with no download: Frechet distance in a "
                                       "classifier's features, its confidence and class spread",
                       description="Trains (once, cached) a small classifier on the labelled training split of "
                                   "--data and scores each image set: Frechet distance of its features to half "
                                   "the test split (real against real gives the floor row), mean confidence, "
                                   "entropy of the predicted classes (imggen.eval.realism).")
    p.add_argument("--images", nargs="*", default=[], metavar="SET", help=".npz/.npy/folders of uint8 28x28 images")
    p.add_argument("--checkpoint", metavar="RUN", help="also score --num samples of this run")
    p.add_argument("--num", type=positive_int, default=1000, help="samples of --checkpoint (default 1000)")
    p.add_argument("--data", default="fashion-mnist", metavar="SPEC", help="fashion-mnist[:DIR] (default) or mnist:DIR")
    p.add_argument("--seed", type=int, default=0, help="sampling, classifier and bootstrap seed (default 0)")
    p.add_argument("--batch-size", type=positive_int, default=64, help="sampling batch (default 64)")
    p.add_argument("--json", metavar="OUT", help="also write the scores to this JSON file")
    add_threads_flag(p)
    return ap


# ------------------------------------------------------------------------------- subcommands
def _write(res: dict, path: str | None) -> None:
    if path:
        from imggen.eval.run import write_json
        write_json(res, path)
        print(f"wrote {path}")


def _note(msg: str | None) -> None:
    if msg:
        print(f"note: {msg}", file=sys.stderr, flush=True)


def cmd_bpd(a) -> int:
    from imggen.eval.run import limit_note, load_run
    from imggen.eval.runners import run_bpd
    run = load_run(a.checkpoint, a.device)
    res = run_bpd(run, spec=a.data, split=a.split, limit=a.limit, bootstrap=a.bootstrap,
                  batch_size=a.batch_size, seed=a.seed)
    _note(limit_note(a.limit, res["n_images"], f"images of the {res['split']} split", "evaluated"))
    ci = res["ci95"]
    ci_s = f" (95% CI {ci[0]:.4f} - {ci[1]:.4f})" if ci else ""
    print(f"{res['split']} bits/dim {res['bpd']:.4f}{ci_s} over {res['n_images']} images of {res['data']}: {res['label']}")
    _write(res, a.json)
    return 0


def cmd_inpaint(a) -> int:
    from imggen.eval.run import limit_note, load_run
    from imggen.eval.runners import run_inpaint
    check_fill_args(a)  # before the model loads
    run = load_run(a.checkpoint, a.device)
    out = a.out or os.path.join(run.path if os.path.isdir(run.path) else os.path.dirname(run.ckpt), "inpaint")
    limit = 16 if a.limit is None else a.limit
    res = run_inpaint(run, spec=a.data, split=a.split, limit=limit, rank=a.rank, seed=a.seed, out=out,
                      batch_size=a.batch_size, **fill_args(a))
    _note(limit_note(a.limit, res["n_images"], f"images with a non-empty mask in the {res['split']} split",
                     "inpainted"))
    print(f"inpainted {res['n_images']} {res['split']} images of {res['data']}: PSNR {res['psnr']:.2f} dB / "
          f"SSIM {res['ssim']:.4f} whole image, PSNR {res['psnr_mask']:.2f} dB / SSIM {res['ssim_mask']:.4f} "
          f"inside the mask; wrote {res['json']} and {len(res['files']['triplets'])} triplets in {out}")
    return 0


def cmd_fid(a) -> int:
    from imggen.eval.run import check_fid_set, load_data, load_images, load_run, split_images
    from imggen.eval.runners import run_fid, sample_images
    if a.checkpoint and a.images_a:
        raise ConfigError("use either --checkpoint (samples as set A) or --images-a, not both")
    if not a.checkpoint and not (a.images_a and a.images_b):
        raise ConfigError("fid needs --images-a A --images-b B, or --checkpoint RUN [--num N]")
    if not a.random_init:
        from imggen.eval.fid import _resolve_weights
        _resolve_weights(a.weights)  # fail before sampling when the weights are missing
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if a.checkpoint:
            run = load_run(a.checkpoint, a.device)
            if a.images_b:
                imgs_b = check_fid_set(load_images(a.images_b), f"--images-b {a.images_b}")
            else:
                spec = a.data or run.cfg.data.spec
                imgs_b = check_fid_set(split_images(load_data(run.cfg, a.data), "test", None),
                                       f"the test split of {spec}")
            imgs_a, _ = sample_images(run, a.num, seed=a.seed, batch_size=a.batch_size)  # after every check
        else:
            imgs_a = check_fid_set(load_images(a.images_a), f"--images-a {a.images_a}")
            imgs_b = check_fid_set(load_images(a.images_b), f"--images-b {a.images_b}")
        res = run_fid(imgs_a, imgs_b, a.weights, a.device, random_init=a.random_init, batch_size=a.batch_size)
    print(f"FID {res['fid']:.3f} ({res['n_a']} vs {res['n_b']} images; {res['note']})")
    _write(res, a.json)
    return 0


def cmd_atoms(a) -> int:
    from imggen.eval.report import atoms_table
    from imggen.eval.run import load_run
    from imggen.eval.runners import run_atoms, run_calibrate
    if a.calibrate:
        if a.checkpoint:
            raise ConfigError("--calibrate scores true drawings only; drop --checkpoint (or drop --calibrate)")
        res = run_calibrate(a.data or "molecules", a.size, a.num)
        c = res["ceiling"]
        print(f"calibration ceiling on {res['num']} test SMILES of {res['data']} at {a.size}x{a.size}:")
        print("| metric | true drawings |\n|---|---|")
        for k, v in c.items():
            if isinstance(v, (int, float)) or v is None:
                print(f"| {k} | {'n/a' if v is None else f'{v:.3f}' if isinstance(v, float) else v} |")
    else:
        if not a.checkpoint:
            raise ConfigError("atoms needs --checkpoint RUN (or --calibrate --data molecules --size N)")
        run = load_run(a.checkpoint, a.device)
        res = run_atoms(run, a.num, a.seed, num_ref=a.num_ref, spec=a.data, batch_size=a.batch_size)
        print(f"atom-bond accuracy of {res['num']} samples vs true drawings of {res['num_ref']} test molecules:")
        print(atoms_table(res))
    _write(res, a.json)
    return 0


def cmd_molecules(a) -> int:
    from imggen.eval.molecules import run_molecules, table
    if bool(a.checkpoint) == bool(a.images):
        raise ConfigError("molecules needs --checkpoint RUN [--num N] or --images DIR (one of them)")
    if a.images:
        from imggen.eval.molecules import load_pngs
        names, images = load_pngs(a.images)
        out = a.out or os.path.normpath(a.images) + "-readback"
    else:
        from imggen.eval.run import load_run
        from imggen.eval.runners import sample_images
        run = load_run(a.checkpoint, a.device)
        if run.cfg.model.channels != 1:
            raise ConfigError(f"molecules needs a grayscale molecule model (channels 1); {a.checkpoint} has "
                              f"{run.cfg.model.channels} channels")
        from imggen.datasets.moses import data_folder
        data_folder()  # the MOSES files are there, before sampling
        imgs, _ = sample_images(run, a.num, seed=a.seed, batch_size=a.batch_size)
        images, names = [x[0] for x in imgs], [f"sample{i:05d}" for i in range(len(imgs))]
        out = a.out or os.path.join(run.run_dir or os.path.dirname(run.ckpt), "molecules")
    res = run_molecules(images, names, out=out, ceiling=a.ceiling, ref_num=a.ref_num, k=a.k)
    print(f"{res['n']} drawings read back by OSRA: {res['n_valid']} valid, {res['unreadable']} unreadable "
          f"(one line each in {res['log']}); picture {res['picture']}")
    for n in res["notes"]:
        print(f"note: {n}")
    print(table(res))
    _write(res, a.json)
    return 0


def cmd_report(a) -> int:
    from imggen.eval.report import make_report
    rep = make_report(a.checkpoint, out=a.out, num=a.num, seed=a.seed, device=a.device, spec=a.data,
                      split=a.split, limit=a.limit, bootstrap=a.bootstrap, inpaint_num=a.inpaint_num,
                      atoms=a.atoms, fid_weights=a.fid_weights, batch_size=a.batch_size)
    b = rep.get("bpd")
    bpd_s = f"{b['split']} bits/dim {b['bpd']:.4f}" if b else "bits/dim n/a"
    print(f"{bpd_s}; wrote {rep['report_json']} and {rep['report_md']}")
    for n in rep.get("notes", []):
        print(f"note: {n}")
    return 0


def cmd_brats(a) -> int:
    from imggen.eval.brats_eval import evaluate, table
    res = evaluate(a.pred, a.data, csv_path=a.csv, slice_axis=a.slice_axis)
    print(table(res))
    skipped = [f"{len(res[k])} {what}" for k, what in (("without_prediction", "case(s) without a prediction"),
                                                        ("failed", "case(s) failed"),
                                                        ("without_truth", "case(s) without -t1n / -mask-healthy"))
               if res[k]]
    print(f"wrote {res['csv']}" + (f"; not scored: {', '.join(skipped)}" if skipped else ""))
    _write(res, a.json)
    return 1 if res["failed"] else 0


def cmd_realism(a) -> int:
    from imggen.eval.realism import realism_for
    from imggen.eval.run import load_images, load_run
    from imggen.eval.runners import sample_images
    if not a.images and not a.checkpoint:
        raise ConfigError("realism needs --images SET [SET ...] and/or --checkpoint RUN")
    sets = {path: load_images(path) for path in a.images}  # every file read before any training
    run = load_run(a.checkpoint, "cpu") if a.checkpoint else None
    score, _ = realism_for(a.data, a.seed, log=lambda m: print(m, file=sys.stderr))
    if run is not None:
        sets[f"{a.checkpoint} ({a.num} samples)"] = sample_images(run, a.num, seed=a.seed, batch_size=a.batch_size)[0]
    res = {name: score.score(imgs, seed=a.seed) for name, imgs in sets.items()}
    for n in sorted({r["n"] for r in res.values()}):
        res[f"test images, real ({n})"] = score.floor(n)
    for name, r in res.items():
        print(f"{name}: Frechet {r['frechet']:.2f} ({r['frechet_ci95'][0]:.2f}-{r['frechet_ci95'][1]:.2f}), "
              f"confidence {r['confidence']:.3f}, class entropy {r['class_entropy']:.2f} bits, n {r['n']}")
    _write(res, a.json)
    return 0


COMMANDS = {"realism": cmd_realism, "bpd": cmd_bpd, "inpaint": cmd_inpaint, "fid": cmd_fid, "atoms": cmd_atoms, "molecules": cmd_molecules,
            "report": cmd_report, "brats": cmd_brats}


def main(argv=None) -> int:
    from imggen.threads import set_threads

    args = build_parser().parse_args(argv)
    set_threads(getattr(args, "threads", None), "eval")
    try:
        return COMMANDS[args.cmd](args)
    except ImggenError as e:
        msg = " ".join(str(e).split())  # one line
        print(f"{PROG} {args.cmd}: error: {msg}", file=sys.stderr)
        return 2
    except (OSError, json.JSONDecodeError) as e:  # unreadable output path etc.
        print(f"{PROG} {args.cmd}: error: {type(e).__name__}: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

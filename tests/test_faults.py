"""What a run survives (README, 'What survives what'): a second run on a busy folder, kill -9 at
random moments, a full disk / quota / read-only folder while anything is written, a dead DDP worker,
damaged cache entries."""
import contextlib
import errno
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import imggen
import imggen.checkpoint as ck
from imggen.training import runlock
from imggen.cli import sample_main, train_main
from imggen.errors import RunBusy
from imggen.training.runlock import RunLock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = ["--preset", "brats", "--data", "brats-demo", "--model.height", "8", "--model.width", "8",
         "--model.dim", "16", "--model.layers", "1", "--model.heads", "2", "--attention", "band",
         "--batch-size", "2", "--limit", "8", "--train.eval_images", "2", "--train.sample_num", "1",
         "--train.log_every", "1", "--train.eval_every", "1000", "--train.ckpt_every", "2", "--no-progress",
         "--train.grid_time_frac", "0", "--threads", "1"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
HOLD = "import sys, time; from imggen.training.runlock import RunLock; RunLock(sys.argv[1]).acquire(); print('held', flush=True); " \
       "time.sleep(300)"



def damage_file(path, how: str) -> None:
    """Truncate the file to half ("truncate") or flip a byte in its middle ("flip")."""
    data = bytearray(path.read_bytes())
    if how == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))

def _train(args, **kw):
    return subprocess.run([sys.executable, "train.py", *SMALL, *args], cwd=REPO, capture_output=True, text=True,
                          env=ENV, **kw)


def _steps(run) -> list[int]:
    """The train_bpd rows' steps of log.jsonl (a row cut by kill -9 is not one)."""
    rows = []
    if os.path.exists(os.path.join(run, "log.jsonl")):
        for line in open(os.path.join(run, "log.jsonl")):
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if "train_bpd" in row:
                rows.append(row["step"])
    return rows


def _snapshot(folder) -> dict:
    return {os.path.relpath(os.path.join(d, f), folder): (os.path.getsize(os.path.join(d, f)),
                                                          os.path.getmtime(os.path.join(d, f)))
            for d, _, files in os.walk(folder) for f in files}


def _holder(run):
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def _lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.strip()]


# ------------------------------------------------------------------------------ one run, one folder
def test_a_second_run_on_a_busy_folder_exits_2_with_one_line_and_writes_nothing(tmp_path):
    run = tmp_path / "run"
    holder = _holder(run)
    try:
        before = _snapshot(run)
        for extra in ([], ["--overwrite"]):
            r = _train(["--steps", "2", "--out", str(run), *extra])
            assert r.returncode == 2, r.stderr[-2000:]
            assert _lines(r.stderr) == [f"train.py: error: {run} is being trained by process {holder.pid} on "
                                        f"{socket.gethostname()} since {time.strftime('%Y-%m-%d')}"
                                        + _lines(r.stderr)[0].split(time.strftime('%Y-%m-%d'))[1]]
            assert _lines(r.stderr)[0].endswith("; stop it or choose another --out")
            assert _snapshot(run) == before
    finally:
        holder.kill()
        holder.wait()


def test_the_lock_of_a_killed_holder_is_taken_over_with_one_note(tmp_path, capfd):
    run = tmp_path / "run"
    holder = _holder(run)
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    with RunLock(str(run)):
        err = _lines(capfd.readouterr().err)
        assert len(err) == 1 and f"was last trained by process {holder.pid}" in err[0], err
        assert "did not end cleanly" in err[0]
        assert json.loads((run / ".lock").read_text())["pid"] == os.getpid()
        with pytest.raises(RunBusy, match=f"process {os.getpid()}"):  # one holder, even within a process
            RunLock(str(run)).acquire()
    assert (run / ".lock").read_text() == ""  # a clean end names no holder: nothing to take over next time
    with RunLock(str(run)):
        assert capfd.readouterr().err == ""


def test_without_file_locks_a_pid_file_guards_the_folder(tmp_path, monkeypatch, capfd):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")
    monkeypatch.setattr(runlock.fcntl, "flock", no_locks)  # an NFS mount without lockd
    run = tmp_path / "run"
    run.mkdir()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    try:
        (run / ".lock").write_text(json.dumps({"pid": live.pid, "host": socket.gethostname(), "started": 0}))
        with pytest.raises(RunBusy, match=f"process {live.pid} on {socket.gethostname()}"):
            RunLock(str(run)).acquire()
    finally:
        live.kill()
        live.wait()
    with RunLock(str(run)):  # the process named is gone: taken over, with the warning about the fallback
        err = capfd.readouterr().err
        assert "has no file locks" in err and f"last trained by process {live.pid}" in err
    (run / ".lock").write_text(json.dumps({"pid": 1, "host": "another-host", "started": 0}))
    with pytest.raises(RunBusy, match=f"if it is gone, remove {run / '.lock'}"):  # cannot be checked from here
        RunLock(str(run)).acquire()


# ------------------------------------------------------------------------------------ kill -9
def test_kill_9_at_random_moments_loses_only_the_steps_since_the_last_checkpoint(tmp_path):
    rng, run, every = random.Random(37), str(tmp_path / "run"), 2
    saved = logged = None
    for k in range(3):
        args = ["--steps", "100000", "--out", run] + (["--resume"] if k else [])
        proc = subprocess.Popen([sys.executable, "train.py", *SMALL, *args], cwd=REPO, text=True,
                                env={**ENV, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        start, deadline = logged or 0, time.time() + 120
        while time.time() < deadline and not [s for s in _steps(run) if s > start]:  # training (again)
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 1.5))  # a random moment: in a step, a log row or a checkpoint write
        proc.send_signal(signal.SIGKILL)
        out, err = proc.communicate(timeout=60)
        if k:  # the run before was killed: its lock is taken over and its last checkpoint continued
            assert f"resumed {run} at step {saved} from" in out, err[-2000:]
            assert "did not end cleanly" in err and "Traceback" not in err, err[-2000:]
        logged, found = _steps(run)[-1], ck.find_checkpoint(run)
        saved = ck.step_of(found)
        assert 0 <= logged - saved <= every, (logged, saved)  # at most the steps since the last checkpoint
        for d in os.listdir(os.path.dirname(found)):  # every checkpoint left loads as what it says it is
            path = os.path.join(os.path.dirname(found), d)
            if d.startswith("step_") and ck.verify(path) is None:
                assert ck.load_state(path)["step"] == ck.step_of(path)
        assert imggen.load_model(run) is not None
    r = _train(["--steps", str(saved + 2), "--out", run, "--resume"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resumed {run} at step {saved}" in r.stdout
    assert _steps(run) == list(range(1, saved + 3))  # no step lost from the log, none twice
    assert not [d for d in os.listdir(os.path.join(run, "checkpoints")) if d.startswith(".tmp")]


# ----------------------------------------------------------------------------- storage failures
def test_a_reader_during_saves_always_loads_a_whole_checkpoint(tmp_path, monkeypatch):
    """sample.py, eval and --brats take no lock: while a run saves every 5 steps (keeping 2; several
    saves a second here), load_model on its folder, over and over, gets a whole checkpoint every
    time, also when the run's cleanup removes the one it resolved (forced once below). A reader
    slower than two save intervals, three times in a row, would still lose the race."""
    run = str(tmp_path / "run")
    proc = subprocess.Popen([sys.executable, "train.py", *SMALL, "--steps", "100000", "--train.ckpt_every", "5",
                             "--out", run], cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and (not os.path.isdir(os.path.join(run, "checkpoints"))
                                          or ck.find_checkpoint(run) is None):
            time.sleep(0.05)
        seen, end = set(), time.time() + 90
        while time.time() < end and len(seen) < 4:
            seen.add(ck.step_of(ck.resolve(run)))
            assert imggen.load_model(run) is not None  # never a CheckpointError, never a half-written folder
        assert len(seen) >= 3, seen  # the run saved while we read
        real, removed = ck.resolve, []

        def resolve_then_lose(path):  # the cleanup wins the race once: the resolved folder vanishes
            found = real(path)
            if not removed:
                removed.append(found)
                shutil.rmtree(found)
            return found
        monkeypatch.setattr(ck, "resolve", resolve_then_lose)
        assert imggen.load_model(run) is not None and removed
    finally:
        proc.kill()
        proc.communicate(timeout=60)


def _enospc(*_, **__):
    raise OSError(errno.ENOSPC, "No space left on device")


def _torch_save_on_a_full_disk(real):
    """torch.save as a full disk makes it fail: a few bytes written, then RuntimeError('unexpected pos')
    with the file object's OSError as its context."""
    def save(obj, f, *a, **kw):
        if not (isinstance(obj, dict) and obj.get("step", 0) >= 4):
            return real(obj, f, *a, **kw)
        f.write(b"PK\x03\x04")
        try:
            _enospc()
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534")
    return save


def _failing_from(n, error):
    """A function that works n times (calling `real`), then raises `error`."""
    def wrap(real):
        calls = [0]

        def f(*a, **kw):
            calls[0] += 1
            if calls[0] > n:
                raise error
            return real(*a, **kw)
        return f
    return wrap


def _inject(monkeypatch, site):
    """Make one kind of write fail from step 3 or 4 on; -> (the path named, the reason)."""
    from PIL import Image
    from torch.utils.tensorboard import SummaryWriter

    from imggen.training import runlog
    if site == "weights":
        real = ck.save_file
        monkeypatch.setattr(ck, "save_file", lambda w, p, metadata: _enospc() if metadata["step"] == "4"
                            else real(w, p, metadata=metadata))
        return "checkpoints/step_0000004/model.safetensors", "no space left on device"
    if site == "state":
        monkeypatch.setattr(torch, "save", _torch_save_on_a_full_disk(torch.save))
        return "checkpoints/step_0000004/state.pt", "no space left on device"
    if site == "log":  # the 4th row: train_bpd of step 4 (eval_every is large)
        monkeypatch.setattr(runlog, "open", _failing_from(3, OSError(errno.EDQUOT, "Disk quota exceeded"))(open),
                            raising=False)
        return "log.jsonl", "disk quota exceeded"
    if site == "tensorboard":
        monkeypatch.setattr(SummaryWriter, "flush", _failing_from(3, OSError(errno.ENOSPC, "No space"))(
            SummaryWriter.flush))
        return "tb", "no space left on device"
    assert site == "grid"  # sample_every 3: the grid of step 3
    monkeypatch.setattr(Image.Image, "save", lambda *a, **kw: _enospc())
    return "samples/step_0000003.png", "no space left on device"


@pytest.mark.parametrize("site", ["weights", "state", "log", "tensorboard", "grid"])
def test_a_full_disk_while_training_writes_is_one_line_exit_1_and_resume_continues(tmp_path, monkeypatch, capfd,
                                                                                     site):
    run = str(tmp_path / "run")
    argv = [*SMALL, "--steps", "6", "--out", run, "--train.sample_every", "3"]
    with monkeypatch.context() as m:
        path, reason = _inject(m, site)
        assert train_main(argv) == 1
    err = _lines(capfd.readouterr().err)
    assert len(err) == 1, err
    assert err[0].startswith(f"train.py: error: cannot write {os.path.join(run, path)}: {reason}; "), err
    assert err[0].endswith(f"the last good checkpoint is step 2 ({run}/checkpoints/step_0000002); free space (or "
                           f"make the folder writable), then continue with: python train.py --out {run} --resume")
    assert not [f for d, dirs, files in os.walk(run) for f in dirs + files if ".tmp" in f]
    assert ck.find_checkpoint(run).endswith("step_0000002")
    assert train_main([*SMALL, "--steps", "6", "--out", run, "--resume"]) == 0
    assert f"resumed {run} at step 2" in capfd.readouterr().out
    assert _steps(run) == [1, 2, 3, 4, 5, 6]


def test_a_full_disk_in_sample_py_and_brats_volumes_is_one_line_exit_1(tmp_path, monkeypatch, capfd):
    import nibabel as nib
    from PIL import Image
    from test_brats_volumes import make_case, random_run

    run = random_run(tmp_path, context="none")
    monkeypatch.setattr(Image.Image, "save", lambda *a, **kw: _enospc())
    out = tmp_path / "out" / "grid.png"
    assert sample_main(["--checkpoint", run, "--num", "1", "--out", str(out), "--no-progress"]) == 1
    err = _lines(capfd.readouterr().err)
    assert err == [f"sample.py: error: cannot write {out}: no space left on device"]
    assert os.listdir(out.parent) == []  # no half-written PNG, no temporary file
    cases = tmp_path / "cases"
    make_case(cases, "BraTS-GLI-00001-000", np.random.default_rng(0))
    make_case(cases, "BraTS-GLI-00002-000", np.random.default_rng(1))
    monkeypatch.setattr(nib, "save", lambda *a, **kw: _enospc())
    pred = tmp_path / "pred"
    assert sample_main(["--checkpoint", random_run(tmp_path), "--brats", str(cases), "--out", str(pred),
                        "--no-progress", "--device", "cpu"]) == 1
    err = _lines(capfd.readouterr().err)
    assert err == [f"sample.py: error: cannot write {pred / 'BraTS-GLI-00001-000-t1n-inference.nii.gz'}: no space "
                   f"left on device; stopped with 0 of 2 case(s) written"]
    assert os.listdir(pred) == []


@pytest.fixture
def tmpfs(tmp_path):
    """A 512 KiB tmpfs (root and a kernel that allows the mount; skipped otherwise)."""
    where = tmp_path / "tmpfs"
    where.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(where)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()[:200]}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def test_a_real_full_disk_is_one_line_and_resume_continues_once_space_is_back(tmpfs):
    run = str(tmpfs / "run")
    r = _train(["--steps", "100000", "--out", run], timeout=300)  # trains until the tmpfs is full
    assert r.returncode == 1, r.stderr[-2000:]
    err = _lines(r.stderr)
    assert len(err) == 1 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert err[0].startswith(f"train.py: error: cannot write {run}/") and ": no space left on device; " in err[0]
    assert f"then continue with: python train.py --out {run} --resume" in err[0]
    assert not [f for d, dirs, files in os.walk(run) for f in dirs + files if ".tmp" in f]
    saved = ck.step_of(ck.find_checkpoint(run))
    assert f"the last good checkpoint is step {saved} " in err[0]
    # a read-only folder: sample.py says so
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    grid = tmpfs / "grid.png"
    p = subprocess.run([sys.executable, "sample.py", "--checkpoint", run, "--num", "1", "--out", str(grid),
                        "--no-progress"], cwd=REPO, capture_output=True, text=True, env=ENV)
    assert p.returncode == 1 and _lines(p.stderr) == [f"sample.py: error: cannot write {grid}: read-only file system"]
    subprocess.run(["mount", "-o", "remount,rw,size=4m", str(tmpfs)], check=True)  # space is back
    r = _train(["--steps", str(saved + 2), "--out", run, "--resume"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resumed {run} at step {saved}" in r.stdout and _steps(run)[-1] == saved + 2


# --------------------------------------------------------------------------------- a dead worker
STOP_S = 60  # README: the surviving processes stop within this (measured: about 1 s on the 2-core box)


def _workers(agent: int) -> dict[int, int]:
    """rank -> pid of the worker processes torchrun's agent `agent` started."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
        except (OSError, ValueError, IndexError):
            continue
        if parent == agent and b"RANK" in env:
            found[int(env[b"RANK"])] = int(pid)
    return found


def _torchrun_and_kill(run, rank, *extra, steps=100000):
    """Train `run` under torchrun (2 gloo processes), kill -9 worker `rank` once training is under way;
    -> (torchrun's return code, its output, seconds from the kill to torchrun's exit)."""
    with socket.socket() as s:  # a port of its own: a group of an earlier test may still hold 29500
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                             "--master_port", str(port), *extra, "train.py", *SMALL, "--steps", str(steps),
                             "--out", run], cwd=REPO, env=ENV, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(_steps(run)) < 8:
            time.sleep(0.05)
        workers = _workers(proc.pid)
        assert sorted(workers) == [0, 1], workers
        os.kill(workers[rank], signal.SIGKILL)
        killed = time.time()
        out, _ = proc.communicate(timeout=STOP_S + 60)
        return proc.returncode, out, time.time() - killed
    finally:  # a run that failed the test leaves no process behind to hold the port or the cores; torchrun
        for pid in _workers(proc.pid).values():  # starts each worker in a session of its own: killpg misses them
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_killed_ddp_worker_stops_the_run_within_the_stated_time_and_resume_continues(tmp_path):
    run = str(tmp_path / "run")
    rc, out, took = _torchrun_and_kill(run, 1, "--max-restarts", "0")
    assert rc != 0 and took < STOP_S, (took, out[-3000:])
    lost = [line for line in out.splitlines() if "another process of this run is gone" in line]
    assert lost and lost[0].startswith("train.py: error: rank 0: "), out[-3000:]
    saved = ck.step_of(ck.find_checkpoint(run))
    assert lost[0].endswith(f"the last good checkpoint is step {saved} ({run}/checkpoints/step_{saved:07d}); "
                            f"continue with: python train.py --out {run} --resume")
    r = _train(["--steps", str(saved + 2), "--out", run, "--resume"])  # one process continues the DDP run
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"resumed {run} at step {saved}" in r.stdout
    assert "did not end cleanly" not in r.stderr  # rank 0 survived and gave its lock back
    assert _steps(run) == list(range(1, saved + 3))


def test_torchrun_max_restarts_resumes_from_the_last_good_checkpoint_after_rank_0_dies(tmp_path):
    run = str(tmp_path / "run")
    rc, out, _ = _torchrun_and_kill(run, 0, "--max-restarts", "1", steps=40)  # the one restart connects
    assert rc == 0, out[-3000:]
    assert "torchrun restarted the workers (restart 1); resuming" in out
    assert "did not end cleanly" in out  # the dead rank 0's lock, taken over by the new rank 0
    assert "resumed " in out and json.load(open(os.path.join(run, "metrics.json")))["steps"] == 40
    assert _steps(run) == list(range(1, 41))


# ------------------------------------------------------------------------------- damaged caches
def test_damaged_render_cache_entries_are_drawn_again_with_one_note(tmp_path, capfd):
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    from imggen.datasets import lazy
    from imggen.datasets import molecules as M

    style = M.style_for(32, 32)
    mols = [s for s in M.read_smiles(M.SAMPLE)[:20] if M.draw_one(s, style)[0] == M.OK][:4]
    first = lazy.LazyMolecules(mols, style, cache_dir=tmp_path, workers=1)[np.arange(4)]
    cache = lazy.RenderCache(style, tmp_path)
    truncated, altered = (cache._path(s).with_suffix(".png") for s in mols[:2])
    truncated.write_bytes(truncated.read_bytes()[:60])
    with Image.open(altered) as im:  # a PNG that decodes, to other pixels: what a flipped byte can give
        pixels, digest = np.asarray(im), im.text[lazy.DIGEST]
    info = PngInfo()
    info.add_text(lazy.DIGEST, digest)
    Image.fromarray(255 - pixels).save(altered, pnginfo=info)
    capfd.readouterr()
    again = lazy.LazyMolecules(mols, style, cache_dir=tmp_path, workers=1)
    assert np.array_equal(again[np.arange(4)], first)  # redrawn: the right pixels, not the damaged ones
    assert again.cache.damaged == 2 and again.cache.misses == 2 and again.cache.hits == 2
    err = _lines(capfd.readouterr().err)
    assert len(err) == 1 and err[0].startswith("note: render cache entry ") and "drawing it again" in err[0], err
    fresh = lazy.LazyMolecules(mols, style, cache_dir=tmp_path, workers=1)  # rewritten whole
    assert np.array_equal(fresh[np.arange(4)], first) and fresh.cache.hits == 4 and fresh.cache.damaged == 0


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_molecules_npz_is_rebuilt_with_one_note(tmp_path, capfd, damage):
    from imggen.datasets import molecules as M

    smiles = M.read_smiles(M.SAMPLE)[:6]
    images, kept = M.render_smiles(smiles, 32, 32, workers=1, cache_dir=tmp_path, progress=False)
    npz = next(tmp_path.glob("molecules-*.npz"))
    damage_file(npz, damage)
    capfd.readouterr()
    again, kept_again = M.render_smiles(smiles, 32, 32, workers=1, cache_dir=tmp_path, progress=False)
    assert np.array_equal(again, images) and np.array_equal(kept_again, kept)
    err = [line for line in _lines(capfd.readouterr().err) if line.startswith("note:")]
    assert len(err) == 1 and f"molecule render cache {npz} is damaged" in err[0], err
    with np.load(npz) as z:  # rebuilt: intact again
        assert np.array_equal(z["images"], images)


def test_a_damaged_native_library_is_rebuilt_with_one_note(tmp_path, monkeypatch, capfd):
    import shutil

    from imggen import cbuild
    from imggen.decode import native
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler")
    monkeypatch.setenv("IMGGEN_CACHE_DIR", str(tmp_path))
    path = native.build()
    good = open(path, "rb").read()
    with open(path, "r+b") as f:
        f.truncate(len(good) // 2)
    capfd.readouterr()
    again = native.build()
    err = _lines(capfd.readouterr().err)
    assert len(err) == 1 and f"the cached native kernel library {path} is damaged" in err[0], err
    rebuilt = open(again, "rb").read()  # whole again, named by its sha256 (the same build where cc is deterministic)
    assert len(rebuilt) > len(good) // 2 and os.path.basename(again).endswith(cbuild.file_sha256(again)[:16] + ".so")
    assert [p.name for p in tmp_path.iterdir()] == [os.path.basename(again)]
    assert native.build() == again and _lines(capfd.readouterr().err) == []  # and used as it is from then on


def test_cached_npz_is_atomic_and_rebuilds_a_damaged_file_with_one_note(tmp_path, monkeypatch, capfd):
    """imggen.storage.cached_npz, under every .npz cache (brats-demo fills, molecule drawings, MOSES
    reference statistics): written through a temporary file and a rename, a damaged or rejected file
    computed again with one note, a failed write leaving the old file and no temporary one."""
    from imggen.storage import cached_npz

    calls = []

    def compute():
        calls.append(1)
        return {"a": np.arange(12, dtype=np.uint8).reshape(3, 4), "s": np.array("text")}
    path = tmp_path / "c" / "x.npz"
    first = cached_npz(path, compute, "test cache")
    assert [p.name for p in path.parent.iterdir()] == ["x.npz"]  # no temporary file left
    assert cached_npz(path, compute, "test cache")["a"].tolist() == first["a"].tolist() and len(calls) == 1
    capfd.readouterr()

    def reject(z):
        raise ValueError("wrong shape")
    assert str(cached_npz(path, compute, "test cache", check=reject)["s"]) == "text" and len(calls) == 2
    err = _lines(capfd.readouterr().err)
    assert len(err) == 1 and f"note: test cache {path} is damaged (ValueError: wrong shape)" in err[0], err
    for i, damage in enumerate(["truncate", "flip"]):
        p = tmp_path / f"d{i}.npz"
        cached_npz(p, compute, "test cache")
        damage_file(p, damage)
        capfd.readouterr()
        again = cached_npz(p, compute, "test cache")
        assert np.array_equal(again["a"], first["a"])
        err = _lines(capfd.readouterr().err)
        assert len(err) == 1 and f"test cache {p} is damaged" in err[0] and "computing it again" in err[0], err
        with np.load(p) as z:  # rebuilt: intact again
            assert np.array_equal(z["a"], first["a"])
    good = path.read_bytes()

    def full_disk(f, **arrays):
        f.write(b"PK partial")
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(np, "savez_compressed", full_disk)
    path.write_bytes(good[:10])  # damaged, and its rewrite fails: the arrays still come back
    capfd.readouterr()
    assert np.array_equal(cached_npz(path, compute, "test cache")["a"], first["a"])
    err = _lines(capfd.readouterr().err)
    assert len(err) == 2 and "cannot keep the test cache" in err[1] and "no space left" in err[1].lower(), err
    assert [p.name for p in path.parent.iterdir()] == ["x.npz"] and path.read_bytes() == good[:10]


def test_a_damaged_moses_reference_cache_is_rebuilt_with_one_note(tmp_path, capfd):
    from imggen.eval import moses_metrics as mm

    ref = mm.reference_stats(["CCO", "c1ccccc1O"], cache_dir=tmp_path)
    (npz,) = tmp_path.glob("moses-ref-*.npz")
    npz.write_bytes(npz.read_bytes()[:100])
    capfd.readouterr()
    again = mm.reference_stats(["CCO", "c1ccccc1O"], cache_dir=tmp_path)
    assert (again["fps"] == ref["fps"]).all() and again["n"] == ref["n"] == 2
    assert again["frag"] == ref["frag"] and again["scaf"] == ref["scaf"]
    err = _lines(capfd.readouterr().err)
    assert len(err) == 1 and f"MOSES reference statistics cache {npz} is damaged" in err[0], err
    with np.load(npz) as z:  # rebuilt: intact again
        assert int(z["n"]) == 2

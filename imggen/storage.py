"""Writes that fail for want of storage -- a full disk (ENOSPC), a quota (EDQUOT), a read-only
folder (EROFS, EACCES) -- become one StorageError naming the path and the reason, whichever
library did the writing: Python's own file objects raise OSError, safetensors and nibabel wrap
it, and torch.save raises RuntimeError ("unexpected pos ...") with the OSError as its context,
or with none at all when it was given a path (then the folder's free space tells).

The on-disk caches of computed arrays live here too: `cache_root` (their folder) and `cached_npz`
(one .npz per key, written atomically; a damaged file is computed again with one note).
"""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

from imggen.errors import StorageError

CODES = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
_TEXT = {"no space left": errno.ENOSPC, "os error 28": errno.ENOSPC, "quota": errno.EDQUOT,
         "os error 122": errno.EDQUOT, "read-only file system": errno.EROFS, "os error 30": errno.EROFS}
LOW_FREE = 1 << 20  # a write that failed where less than this is free failed for want of space
_noted: set[str] = set()


def note_once(msg: str) -> None:
    """One 'note: MSG' line on stderr, once per process (e.g. a damaged cache entry being rebuilt)."""
    if msg not in _noted:
        _noted.add(msg)
        print(f"note: {msg}", file=sys.stderr, flush=True)


def _existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def storage_errno(exc: BaseException, path: str) -> int | None:
    """The errno of a failed write to `path` when storage is why it failed, else None."""
    seen = exc
    while seen is not None:  # the OSError under torch's or a library's wrapper
        if isinstance(seen, OSError) and seen.errno in CODES:
            return seen.errno
        text = str(seen).lower()
        for needle, code in _TEXT.items():
            if needle in text:
                return code
        seen = seen.__cause__ or seen.__context__
    if isinstance(exc, (OSError, RuntimeError)) or type(exc).__name__ == "SafetensorError":
        try:
            if shutil.disk_usage(_existing(path)).free < LOW_FREE:
                return errno.ENOSPC
        except OSError:
            pass
    return None


def reason(code: int) -> str:
    """'no space left on device', 'disk quota exceeded', 'read-only file system', ..."""
    return os.strerror(code).lower()


@contextlib.contextmanager
def writing(path, cleanup=None):
    """Run a write of `path` (or of `path()`, the file being written when it fails); a failure for want
    of storage becomes StorageError("cannot write PATH: REASON") with no traceback chained to it,
    after `cleanup()` (e.g. removing a temporary file)."""
    try:
        yield
    except StorageError:
        raise
    except Exception as e:  # noqa: BLE001 - storage failures come wrapped in several types
        path = os.fspath(path() if callable(path) else path)
        code = storage_errno(e, path)
        if cleanup is not None:
            with contextlib.suppress(OSError):
                cleanup()
        if code is None:
            raise
        raise StorageError(f"cannot write {path}: {reason(code)}", code) from None


def atomic_write_text(path: str, text: str) -> None:
    """Write `path` through a temporary file and a rename; a StorageError (no temporary file left) when
    storage fails."""
    tmp = None

    def remove():
        if tmp is not None and os.path.exists(tmp):
            os.remove(tmp)
    with writing(path, remove):
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".tmp-")
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


# ------------------------------------------------------------------------------- array caches
def cache_root(cache_dir=None) -> Path:
    """The cache folder: `cache_dir`, else $IMGGEN_CACHE_DIR, $IMGGEN_CACHE (older name), ~/.cache/imggen."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("IMGGEN_CACHE_DIR") or os.environ.get("IMGGEN_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "imggen"


def read_npz(path, check=None) -> dict:
    """The arrays of the .npz `path`, checked by `check(arrays)`; raises when it cannot be read (np.load
    checks each member's zip CRC) or when `check` rejects it."""
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    if check is not None:
        check(arrays)
    return arrays


def cached_npz(path, compute, what: str, check=None) -> dict:
    """The arrays kept in the .npz `path`, else compute() -> {name: array}, kept there through a
    temporary file and a rename. A file that cannot be read (np.load checks each member's zip CRC,
    so a truncated or altered one fails) or that `check(arrays)` rejects (it raises) is computed again
    with one note naming `what` (e.g. "molecule render cache"); a cache that cannot be written only
    costs the time (one note)."""
    path = Path(path)
    if path.is_file():
        try:
            return read_npz(path, check)
        except Exception as e:  # noqa: BLE001 - zipfile, numpy, zlib and check raise several types
            note_once(f"{what} {path} is damaged ({type(e).__name__}: {e}); computing it again")
    arrays = compute()
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=".tmp.npz")
        with os.fdopen(fd, "wb") as f:
            np.savez_compressed(f, **arrays)
        os.replace(tmp, path)
    except OSError as e:  # a read-only or full cache
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)
        note_once(f"cannot keep the {what} in {path.parent} ({e.strerror or e})")
    return arrays

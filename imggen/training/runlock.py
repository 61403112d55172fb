"""One run folder, one writer: train.py holds an exclusive lock on RUN/.lock while it runs.

The lock is `fcntl.flock` on RUN/.lock, which names its holder (process id, host, start time). The
kernel drops a flock when its process ends in any way (exit, crash, kill -9, reboot), so a lock left
by a dead run is free and the next run takes it over; the holder's name still in the file is how the
next run knows that the last one did not end cleanly (one note line). A clean exit empties the file.

Where the filesystem has no locks (some NFS mounts: flock raises ENOLCK / EOPNOTSUPP), the file is a
plain PID file: a run refuses a folder whose file names a live process on this host, or any process on
another host (which it cannot check; remove the file when that run is gone), and takes it over from a
dead process on this host, with one warning line that the folder is not protected against two runs
started at the same moment.
"""
from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time

from imggen.errors import RunBusy
from imggen.storage import writing

NAME = ".lock"
NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _holder(text: str) -> dict | None:
    try:
        info = json.loads(text)
        return info if isinstance(info, dict) and isinstance(info.get("pid"), int) else None
    except ValueError:
        return None


def _describe(out: str, info: dict) -> str:
    since = time.strftime("%Y-%m-%d %H:%M", time.localtime(info.get("started", 0)))
    return f"process {info['pid']} on {info.get('host', '?')} since {since}"


class RunLock:
    """The lock of run folder `out`: `acquire()` takes it (RunBusy when a live run holds it),
    `release()` gives it back; also a context manager."""

    def __init__(self, out: str):
        self.out, self.path, self.fd, self.locked = out, os.path.join(out, NAME), None, False

    def acquire(self) -> "RunLock":
        with writing(self.path):
            os.makedirs(self.out, exist_ok=True)
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self.locked = True
        except BlockingIOError:
            info = _holder(self._read())
            self._close()
            who = _describe(self.out, info) if info else "another process"
            raise RunBusy(f"{self.out} is being trained by {who}; stop it or choose another --out") from None
        except OSError as e:
            if e.errno not in NO_LOCKS:
                self._close()
                raise
            self._pid_file_check(e)
        previous = _holder(self._read())
        if previous and previous.get("pid") != os.getpid():
            print(f"note: {self.out} was last trained by {_describe(self.out, previous)}, which did not end "
                  f"cleanly (killed or crashed); this run takes the folder over", file=sys.stderr, flush=True)
        self._write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}))
        return self

    def _pid_file_check(self, e: OSError) -> None:
        info = _holder(self._read())
        here = socket.gethostname()
        if info and info["pid"] != os.getpid() and (info.get("host") != here or _alive(info["pid"])):
            self._close()
            gone = "" if info.get("host") == here else f" (if it is gone, remove {self.path})"
            raise RunBusy(f"{self.out} is being trained by {_describe(self.out, info)}{gone}; stop it or choose "
                          f"another --out")
        print(f"warning: {self.path}: this filesystem has no file locks ({os.strerror(e.errno)}); using a PID "
              f"file, which does not stop two runs started at the same moment", file=sys.stderr, flush=True)

    def _read(self) -> str:
        try:
            os.lseek(self.fd, 0, os.SEEK_SET)
            return os.read(self.fd, 4096).decode("utf-8", "replace")
        except OSError:
            return ""

    def _write(self, text: str) -> None:
        with writing(self.path):
            os.ftruncate(self.fd, 0)
            os.pwrite(self.fd, text.encode(), 0)

    def _close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)  # closing the last descriptor drops the flock
            self.fd = None

    def release(self) -> None:
        """A clean end: empty the file (no holder named: the next run has nothing to take over), unlock."""
        if self.fd is None:
            return
        try:
            os.ftruncate(self.fd, 0)
        except OSError:
            pass  # a full disk cannot stop a truncate; a read-only folder leaves the name: one note next time
        self._close()
        self.locked = False

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()

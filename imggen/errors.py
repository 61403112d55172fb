"""Errors with messages that name the file/argument and the fix."""


class ImggenError(Exception):
    """Base class for every error the toolkit raises on bad input."""


class ConfigError(ImggenError, ValueError):
    """A bad configuration value or flag."""


class ShapeError(ImggenError, ValueError):
    """An image/tensor of the wrong shape, dtype or value range."""


class DataError(ImggenError, ValueError):
    """A dataset file that is missing, corrupt or in an unexpected format."""


class CheckpointError(ImggenError):
    """A checkpoint that is missing, corrupt, or from a different config."""


class TrainingError(ImggenError, RuntimeError):
    """Training cannot continue (e.g. NaN loss)."""


class Interrupted(ImggenError):
    """Training stopped by SIGINT/SIGTERM after saving a checkpoint (exit code 130)."""


class StorageError(ImggenError):
    """A file that could not be written for want of storage: a full disk, a quota, a read-only
    folder (exit code 1). The message names the path and the reason; `errno` is the cause's."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.errno = code


class RunBusy(ImggenError):
    """A run folder another live process is training into (its lock is held; exit code 2)."""


class WorkerLost(TrainingError):
    """Under torchrun: another process of the run died, so its collectives failed (exit code 1)."""

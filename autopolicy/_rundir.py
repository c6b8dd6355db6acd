"""Run directories: checked before any work, locked against a second run, cleaned of the
temporary files of killed runs.

Two runs writing one directory at once spoil each other: their timings, taken while they fight
over the same cores, go into the shared measurement cache, and the last writer's map wins. So a
run takes an exclusive lock on its directory (``flock`` on a ``.lock`` file that holds its
process id); a second run is refused at once, naming that process. The kernel drops the lock
when its process dies, however it dies, so the lock of a killed run is taken over by the next
run, which then removes the temporary files the killed run left (see :mod:`autopolicy._atomic`).
"""

from __future__ import annotations

import errno
import logging
import os
import tempfile
import time
from typing import Any

from autopolicy import _atomic, _json

try:  # POSIX; elsewhere the lock falls back to the process id in the lock file
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

__all__ = ["LOCK_FILE", "RunDirectoryLocked", "RunLock", "check_directory", "check_output_file", "remedy"]

LOCK_FILE = ".lock"

logger = logging.getLogger("autopolicy")

# flock is not supported here (some network file systems): fall back to the process id.
_NO_FLOCK = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


class RunDirectoryLocked(BlockingIOError):
    """Another process holds the lock of a run directory.

    Attributes:
      directory: The locked directory.
      pid: The process id of the holder (None when it cannot be read).
    """

    def __init__(self, directory: str, pid: int | None):
        holder = "another process" if pid is None else f"process {pid}"
        if pid == os.getpid():
            holder += " (this process)"
        super().__init__(
            f"{directory!r} is in use by {holder}: two runs on one directory would spoil each other's "
            "measurements. Wait for it to finish, stop it, or choose another directory."
        )
        self.directory = directory
        self.pid = pid


_REMEDIES = {
    errno.EACCES: "check its permissions or choose another directory",
    errno.EPERM: "check its permissions or choose another directory",
    errno.EROFS: "the file system is read-only: choose another directory",
    errno.ENOSPC: "free some disk space and run again",
    errno.EDQUOT: "free some disk space (over quota) and run again",
}


def remedy(error: OSError) -> str:
    """What to do about a file system error, or "" when there is nothing general to say.

    >>> remedy(OSError(errno.ENOSPC, "No space left on device"))
    'free some disk space and run again'
    """
    return _REMEDIES.get(error.errno, "")


def _failure(error: OSError, message: str) -> OSError:
    """``error``'s kind (PermissionError, ...) with ``message`` and a remedy (``error`` becomes its
    cause: setting errno here would make ``str()`` drop the message)."""
    advice = remedy(error)
    return type(error)(f"{message}: {advice}" if advice else message)


def check_directory(path: Any, what: str = "run directory") -> str:
    """Creates the directory ``path`` if needed and checks that files can be written in it.

    Args:
      path: A str or os.PathLike.
      what: How messages name it (``"--out"``, ``"cache_dir"``).

    Returns:
      ``path`` as a str.

    Raises:
      TypeError: if ``path`` is not a str or os.PathLike.
      NotADirectoryError: if it (or a parent) is a file.
      PermissionError, OSError: if it cannot be created or written; the message names it.

    >>> check_directory(__file__)
    Traceback (most recent call last):
    ...
    NotADirectoryError: run directory '...' is a file, not a directory: name a directory (it is created if missing)
    """
    path = _json.check_path(path, what)
    _check_dir(path, f"{what} {path!r}")
    return path


def _check_dir(path: str, described: str) -> None:
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(f"{described} is a file, not a directory: name a directory (it is created "
                                 "if missing)")
    try:
        os.makedirs(path, exist_ok=True)
    except (NotADirectoryError, FileExistsError) as e:
        raise _failure(e, f"cannot create {described}: {_file_in(path) or path!r} is a file") from e
    except OSError as e:
        raise _failure(e, f"cannot create {described}: {e.strerror}") from e
    try:  # os.access is not enough: root passes it on read-only mounts, network file systems lie
        fd, probe = tempfile.mkstemp(dir=path, prefix=_atomic.TMP_PREFIX + "probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise _failure(e, f"cannot write in {described}: {e.strerror}") from e


def _file_in(path: str) -> str | None:
    """The first part of ``path`` that exists and is not a directory, or None."""
    parts = os.path.abspath(path).split(os.sep)
    for i in range(2, len(parts) + 1):
        prefix = os.sep.join(parts[:i])
        if os.path.exists(prefix) and not os.path.isdir(prefix):
            return prefix
    return None


def check_output_file(path: Any, what: str = "--out") -> str:
    """Checks, before any work, that the file ``path`` can be written (its directory is created).

    Raises:
      TypeError: if ``path`` is not a str or os.PathLike.
      IsADirectoryError: if ``path`` is a directory.
      NotADirectoryError, PermissionError, OSError: if its directory cannot be created or written.
    """
    path = _json.check_path(path, what)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{what} {path!r} is a directory: name a file")
    parent = os.path.dirname(os.path.abspath(path))
    blocking = _file_in(parent)
    if blocking is not None:
        raise NotADirectoryError(f"cannot write {what} {path!r}: {blocking!r} is a file, not a directory")
    _check_dir(parent, f"the directory {parent!r} of {what} {path!r}")
    return path


def _read_pid(fd: int) -> int | None:
    for _ in range(10):  # the holder writes its id just after it locks: give it a moment
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
        if text.isdigit():
            return int(text)
        time.sleep(0.02)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class RunLock:
    """An exclusive lock on a directory, for one process at a time.

    Acquiring it creates the directory, writes this process's id into ``directory/.lock`` and
    removes the ``.tmp-*`` files of killed runs. A lock whose process has died is taken over.

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     with RunLock(d) as lock:
    ...         RunLock(d).acquire()
    Traceback (most recent call last):
    ...
    autopolicy._rundir.RunDirectoryLocked: '...' is in use by process ... (this process): ...
    """

    def __init__(self, directory: Any, what: str = "run directory"):
        self.directory = _json.check_path(directory, what)
        self.what = what
        self.path = os.path.join(self.directory, LOCK_FILE)
        self.removed: list[str] = []  # orphaned temporary files removed on acquiring
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock."""
        return self._fd is not None

    def acquire(self) -> "RunLock":
        """Takes the lock, or raises :class:`RunDirectoryLocked` at once if another holds it.

        Raises:
          RunDirectoryLocked: naming the process that holds the lock.
          NotADirectoryError, PermissionError, OSError: as :func:`check_directory`.
        """
        if self._fd is not None:
            return self
        check_directory(self.directory, self.what)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            self._lock(fd)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.removed = _atomic.remove_orphans(self.directory)
        if self.removed:
            logger.info("removed temporary files of an interrupted run in %s: %s", self.directory, self.removed)
        return self

    def _lock(self, fd: int) -> None:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                raise RunDirectoryLocked(self.directory, _read_pid(fd)) from None
            except OSError as e:
                if e.errno not in _NO_FLOCK:
                    raise
        pid = _read_pid(fd)  # no flock: the id in the file, if that process still lives
        if pid is not None and pid != os.getpid() and _alive(pid):
            raise RunDirectoryLocked(self.directory, pid)

    def release(self) -> None:
        """Gives the lock back (a no-op when not held)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)  # no stale id for the next reader
        except OSError:
            pass
        finally:
            os.close(fd)  # closing the descriptor drops the flock

    def __enter__(self) -> "RunLock":
        return self.acquire()

    def __exit__(self, *exc_info: Any) -> None:
        self.release()

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            self.release()

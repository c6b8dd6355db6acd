"""Atomic file writes: a reader sees the old file or the new one, never half of one.

Each write goes to a temporary ``.tmp-*`` file beside its target, then replaces it with a rename.
A process killed between the two leaves that temporary file behind; :func:`remove_orphans`
deletes such files at the next run of the directory (under its lock, see
:mod:`autopolicy._rundir`).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from typing import Any

TMP_PREFIX = ".tmp-"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _with_path(error: OSError, path: str) -> OSError:
    """The same kind of error, naming the file being written (a failed write names none)."""
    if error.filename is not None:
        return error
    if error.errno is None:
        return type(error)(f"{error} (writing {path!r})")
    return type(error)(error.errno, error.strerror, path)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Writes ``data`` to ``path`` through a temporary file and a rename.

    Raises:
      OSError: naming ``path``, when the directory cannot be created or written (a full disk,
        missing permissions); the target is then unchanged and no temporary file is left.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=TMP_PREFIX, suffix="-" + os.path.basename(path))
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; give the file normal permissions
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        _discard(tmp)
        raise _with_path(e, path) from e
    except BaseException:
        _discard(tmp)
        raise


def _discard(tmp: str) -> None:
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass


def write_text(path: str | os.PathLike, text: str) -> None:
    """Writes UTF-8 ``text`` to ``path`` atomically."""
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Writes ``obj`` as indented JSON (with a final newline) to ``path`` atomically."""
    write_text(path, json.dumps(obj, indent=2, allow_nan=False) + "\n")


def remove_orphans(directory: str | os.PathLike, older_than: float = 0.0) -> list[str]:
    """Deletes the temporary files that killed writers left in ``directory``.

    Call it only where no other process writes at the same time (under the directory's lock),
    or with ``older_than`` (seconds) well above the time one write takes.

    Args:
      directory: The directory to clean (not its subdirectories); a missing one is left alone.
      older_than: Only files last modified at least this many seconds ago.

    Returns:
      The names of the files removed.

    >>> import pathlib, tempfile
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> _ = (d / ".tmp-abc-summary.json").write_text("{")
    >>> remove_orphans(d), sorted(p.name for p in d.iterdir())
    (['.tmp-abc-summary.json'], [])
    >>> d.rmdir()
    """
    removed = []
    try:
        names = sorted(os.listdir(directory))
    except (FileNotFoundError, NotADirectoryError):
        return removed
    now = time.time()
    for name in names:
        if not name.startswith(TMP_PREFIX):
            continue
        path = os.path.join(directory, name)
        try:
            if not os.path.isfile(path) or now - os.path.getmtime(path) < older_than:
                continue
            os.unlink(path)
        except FileNotFoundError:  # removed meanwhile
            continue
        removed.append(name)
    return removed

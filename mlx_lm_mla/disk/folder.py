"""The tier's own folder in DIR, marked with its format; in it the tier touches
only names of its own forms. Each process holds an ``flock`` on a file named for
a random id its temporary files carry, so they are known live or dead whatever
PIDs later processes get (a container's PID 1 is every run's)."""

import contextlib
import errno
import fcntl
import json
import os
import re
import stat
import string
import uuid
from pathlib import Path

from .fingerprint import FORMAT

SUBFOLDER = "mlx-lm-mla-prompt-caches"
MARKER = "mlx-lm-mla-caches.json"
INDEX = "index.sqlite"
ASIDE = f"{INDEX}.aside-"  # an index moved aside, its stamp, maybe a journal's tail
SUFFIX = ".safetensors"
_TEMP, _LOCK = "tmp-", "live-"
TRANSIENT = (_TEMP, _LOCK)  # how the names of temporary files and locks start
_DIGITS = string.hexdigits[:16]
_VERSION = re.compile(r"mlx-lm-mla-disk-([0-9]+)")
_ID = 32  # hex digits of a process id and of a cache file's name


class NotOurs(Exception):
    """A folder the tier cannot use, and why."""


class Unusable(NotOurs):
    """A folder the tier cannot use now (it cannot make it, or it holds an older
    format's caches): the server starts without the tier, saying why."""


class OlderFormat(Unusable):
    """The tier's folder, marked with an older format."""


def older_format(found):
    """Whether a folder's marker names a format older than this one's."""
    old, new = _VERSION.fullmatch(str(found)), _VERSION.fullmatch(FORMAT)
    return bool(old and new and int(old[1]) < int(new[1]))


def _hex(text, n):
    return len(text) == n and not text.strip(_DIGITS)  # in C: every start, every file


def cache_name(digest):
    return f"{digest[:_ID]}{SUFFIX}"


def is_cache_name(name):
    return name.endswith(SUFFIX) and _hex(name[: -len(SUFFIX)], _ID)


def temp_name(owner):
    return f"{_TEMP}{owner}-{uuid.uuid4().hex}{SUFFIX}"


def temp_owner(name):
    """The process id a temporary file of the tier carries, or None."""
    if not (name.startswith(_TEMP) and name.endswith(SUFFIX)):
        return None
    owner, _, rest = name[len(_TEMP) : -len(SUFFIX)].partition("-")
    return owner if _hex(owner, _ID) and _hex(rest, _ID) else None


def lock_owner(name):
    owner = name[len(_LOCK) : -len(".lock")]
    return (
        owner
        if name.startswith(_LOCK) and name.endswith(".lock") and _hex(owner, _ID)
        else None
    )


def aside_stamp(name):
    """The stamp of an index moved aside (or of its journal), or None."""
    if not name.startswith(ASIDE):
        return None
    stamp = name[len(ASIDE) :]
    for tail in ("-journal", "-wal", "-shm"):
        stamp = stamp.removesuffix(tail)
    day, _, rest = stamp.partition("T")
    clock, _, code = rest.partition("-")
    ok = day.isdigit() and len(day) == 8 and clock.isdigit() and len(clock) == 6
    return stamp if ok and _hex(code, 6) else None


def is_regular(path):
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _marker_text():
    return (
        json.dumps(
            {
                "format": FORMAT,
                "what": "prompt caches of mlx-lm-mla's disk tier "
                "(--prompt-cache-dir); `mlx-lm-mla cache-dir clear DIR` empties it",
            }
        )
        + "\n"
    )


def _read_marker(path):
    """The format a marker names; None where there is none or it names none.
    A marker that cannot be read raises: it is not a missing one."""
    try:
        return json.loads(path.read_text()).get("format")
    except (FileNotFoundError, ValueError, AttributeError):
        return None


def _cannot(what, path, error):
    """Unusable where permissions or a read-only disk stop the tier, else
    NotOurs; naming ``path`` and the error."""
    kind = (
        Unusable if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS) else NotOurs
    )
    return kind(f"cannot {what} {path}: {error.strerror or error}")


def _unsafe(path, info):
    """Why another user could change what the tier reads at ``path`` (its
    ``lstat``), or None: it is not this process's, or others can write it (a
    link's mode means nothing; in a folder of this user's, this user made it)."""
    if info.st_uid != os.geteuid():
        return (
            f"{path} belongs to user {info.st_uid}, not this process's ({os.geteuid()})"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not stat.S_ISLNK(info.st_mode):
        mode = stat.S_IMODE(info.st_mode)
        return f"{path} can be written by its group or other users (mode {mode:04o})"
    return None


def _refuse_unsafe(path, info):
    why = _unsafe(path, info)
    if why:
        raise Unusable(
            f"{why}: another user could replace its prompt caches; make it this "
            "user's with mode 0700 (its files 0600), or choose another folder"
        )


def open_folder(directory, create=True):
    """The tier's folder in ``directory``, made (mode 0700) and marked if
    ``create``; NotOurs, naming why, where it is not the tier's or unusable."""
    directory = Path(directory).expanduser().absolute()
    folder = directory / SUBFOLDER
    try:
        if directory.exists() and not directory.is_dir():
            raise NotOurs(f"{directory} is not a directory")
        if create:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                folder.mkdir(mode=0o700)
        info = os.lstat(folder)
    except FileNotFoundError:
        raise NotOurs(f"{folder} does not exist")
    except OSError as e:
        raise _cannot("make" if create else "open", folder, e)
    if not stat.S_ISDIR(info.st_mode):
        raise NotOurs(
            f"{folder} is not a directory of the tier; move it or choose another folder"
        )
    _refuse_unsafe(folder, info)
    marker = folder / MARKER
    try:
        found = _read_marker(marker)
    except OSError as e:
        raise _cannot("read", marker, e)
    try:
        if found is None and create and set(os.listdir(folder)) <= {MARKER}:
            # Empty, or marked by a start that was cut short: nothing to lose.
            _write_marker(marker)
            found = _read_marker(marker)
    except OSError as e:
        raise _cannot("mark", folder, e)
    for name in (MARKER, INDEX):
        try:
            info = os.lstat(folder / name)
        except OSError:
            continue  # none yet; or unreadable, which opening it says
        _refuse_unsafe(folder / name, info)
    if found is None:
        raise NotOurs(
            f"{folder} has no marker of the tier ({MARKER}), so what it holds "
            "is not the tier's; move it or choose another folder"
        )
    if older_format(found):
        raise OlderFormat(
            f"{folder} holds prompt caches of an older mlx-lm-mla (format {found}), "
            f"which this one does not read; `mlx-lm-mla cache-dir clear {directory}` "
            "removes them"
        )
    if found != FORMAT:
        raise NotOurs(
            f"{folder} holds prompt caches of another version of "
            f"mlx-lm-mla (format {found}, this one reads {FORMAT}); "
            "delete that folder or choose another"
        )
    return folder  # written to or not: the tier reads one it cannot write


def _write_marker(path):
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return  # another process marked it at the same moment
    with os.fdopen(fd, "w") as f:
        f.write(_marker_text())
        f.flush()
        os.fsync(f.fileno())


@contextlib.contextmanager
def maintenance(folder):
    """Held while a process sweeps or repairs the folder: one at a time."""
    fd = os.open(Path(folder) / MARKER, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


class Presence:
    """This process's lock on the folder, made during ``maintenance`` so no sweep
    sees it unlocked."""

    def __init__(self, folder):
        self.id = uuid.uuid4().hex
        self.path = Path(folder) / f"{_LOCK}{self.id}.lock"
        self._fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def release(self):
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            os.close(self._fd)
            self._fd = None


def alive(folder, owner):
    """Whether the process with id ``owner`` still holds the folder."""
    try:
        fd = os.open(Path(folder) / f"{_LOCK}{owner}.lock", os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # and with it the lock just taken
    return False

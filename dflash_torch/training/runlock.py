"""The lock that keeps two training runs out of one output or work directory at once."""

from __future__ import annotations

import os
from contextlib import suppress
from pathlib import Path

from ..errors import OptionError, quoted

LOCK_NAME = ".dflash-train.lock"  # (the lock file a run holds in its out and work dirs while it runs)


def holder_pid(path: Path) -> int | None:
    """The process ID of the process that holds the ``flock`` lock on the file ``path``, as
    Linux's ``/proc/locks`` lists it (the PID that took it); None where it cannot be told
    (another OS, a file system whose locks that table names by another device, the file gone)."""
    try:
        st = os.stat(path)
        inode = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        with open("/proc/locks", encoding="ascii") as table:  # ("1: FLOCK  ADVISORY  WRITE PID MAJ:MIN:INODE 0 EOF";
            for line in table:  # a waiter's line reads "1: -> FLOCK ...")
                fields = line.split()
                if len(fields) > 5 and fields[1] == "FLOCK" and fields[5] == inode and int(fields[4]) > 0:
                    return int(fields[4])
    except (OSError, ValueError):
        pass
    return None


def _is_file(path: Path) -> bool:
    """Whether ``path`` is a file; False where it cannot be told (a directory this process may not enter)."""
    try:
        return path.is_file()
    except OSError:
        return False


class RunLock:
    """A training run's hold on its directories: :meth:`take` locks each one (a lock file
    ``.dflash-train.lock`` in it, held with ``filelock``: an OS lock, which the OS drops when
    the process ends however it ends, so that a run killed with SIGKILL leaves a file that
    blocks no later run), refusing a directory another live run holds; :meth:`release` lets
    them go (their files removed first, while still held). Usable once."""

    def __init__(self):
        self._held: list[tuple[Path, object]] = []  # (lock file, its filelock.FileLock), in the order taken

    def take(self, dirs: dict[str, tuple[str, Path]], existing: bool = False) -> None:
        """Lock the directories ``dirs`` (field name -> (the path as given, the path)) that this
        run does not hold yet (one directory under two names is locked once). With ``existing``,
        only those that hold a lock file already (another run's, live or not; a directory
        is not made, nor a lock file, and one that cannot be locked is left to
        :func:`~dflash_torch.training.trainer.check_run_dirs` to say).

        Raises:
            OptionError: a directory another run holds, naming it, its field, and where the OS
                tells it, that run's process ID; without ``existing``, a lock file that cannot
                be made or locked (an OS error), naming its directory and the reason.
        """
        from filelock import FileLock, Timeout

        for key, (shown, path) in dirs.items():
            file = Path(os.path.realpath(path)) / LOCK_NAME
            if any(file == held for held, _ in self._held) or (existing and not _is_file(file)):
                continue
            lock = FileLock(str(file), timeout=0)
            try:
                lock.acquire()
            except Timeout:
                pid = holder_pid(file)
                raise OptionError(f"{key} {quoted(shown)} is in use by another training run"
                                  f"{f' (PID {pid})' if pid is not None else ''}: wait for it to end, or give another "
                                  f"{key}", key, key) from None
            except OSError as exc:
                if existing:
                    continue
                raise OptionError(f"cannot use {key} {quoted(shown)} as a directory: cannot lock {file}: "
                                  f"{exc.strerror or exc}", key) from None
            self._held.append((file, lock))

    def release(self) -> None:
        """Let go of every directory held (each lock file removed while still held: a run that
        takes the directory meanwhile makes a new one); a second call does nothing."""
        while self._held:
            file, lock = self._held.pop()
            with suppress(OSError):  # (Windows: filelock removes it itself, and an open file cannot be removed)
                file.unlink()
            lock.release()

"""The output folder (``-o``): checked before any work, written as a hidden staging folder beside
it, and swapped in at the end without deleting anything the exporter did not check.

- Up front: ``-o`` is absent, or a package with ``--overwrite``; its nearest existing parent is a
  folder this process can write in; later, once the plan knows the weights, the disk has room.
- Staging: ``.NAME.partial-XXXX`` beside ``-o`` holds ``package/`` (what becomes ``-o``) and a lock
  file (``fcntl.flock``) held for as long as its export runs. A staging folder of the same destination whose lock nobody holds is left over
  from a killed export and is removed; one without the lock file was not made by this exporter
  and is left alone.
- Swap: the old package is moved aside into the staging folder (``previous/``, under the same
  lock), checked to be what was checked at the start (the same folder, the same entries, nothing
  its export did not write), the new one moved in, and only then the old one renamed
  ``superseded/`` and deleted. If ``-o`` changed meanwhile, nothing is replaced and the error says
  so. An export killed between the two moves leaves the old package in ``previous/`` with
  ``-o`` absent and the new one in ``package/``: the next export of that destination moves the
  old one back. A ``previous/`` in any other state is kept, never deleted.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from exporter.errors import ExporterError, nearest_existing
from exporter.package.files import GENAI_CONFIG_FILENAME
from exporter.units import size_text

LOCK_NAME = ".export.lock"
_STAGING = ".partial-"
_PREVIOUS = "previous"


@dataclass(frozen=True)
class Destination:
    path: Path
    # What -o was when checked: None (absent), or its device, inode and entry names.
    state: tuple | None


def check_destination(output_dir: Path, overwrite: bool) -> Destination:
    """Raises ExporterError, naming ``-o``, for a destination the export could not write to."""
    output_dir = Path(output_dir).resolve()  # a link to a folder: the folder is what is replaced
    if output_dir.parent.is_dir():
        # First: a killed export's folder is room, and may hold the old package to move back.
        remove_stale_staging(output_dir)
    if output_dir.exists():
        if not output_dir.is_dir():
            raise ExporterError(f"-o '{output_dir}' is a file; choose a folder path for -o")
        if not overwrite:
            raise ExporterError(f"-o '{output_dir}' exists; choose another -o or pass --overwrite")
        # --overwrite deletes the folder: only ever one that holds a package (or nothing), so a
        # mistyped -o cannot wipe a folder of other files.
        if any(output_dir.iterdir()) and not (output_dir / GENAI_CONFIG_FILENAME).is_file():
            raise ExporterError(f"-o '{output_dir}' exists and is not a package (no {GENAI_CONFIG_FILENAME}); "
                                "--overwrite only replaces packages: choose another -o")
        if foreign := _not_from_the_export(output_dir):
            raise ExporterError(f"-o '{output_dir}' holds '{foreign}', which its export did not write; "
                                "--overwrite would delete it: move it out of -o or choose another -o")
        if not os.access(output_dir, os.W_OK | os.X_OK):
            raise ExporterError(f"-o '{output_dir}' cannot be replaced: it is read-only, immutable or not ours; "
                                "choose another -o")
    ancestor = nearest_existing(output_dir.parent)
    staging_name = f".{output_dir.name}{_STAGING}XXXXXXXX"
    if ancestor.is_dir() and len(os.fsencode(staging_name)) > os.pathconf(ancestor, "PC_NAME_MAX"):
        raise ExporterError(f"-o '{output_dir}': the name '{output_dir.name}' is too long for this file system "
                            f"(the export writes beside it as '{staging_name}', over "
                            f"{os.pathconf(ancestor, 'PC_NAME_MAX')} bytes); choose a shorter -o")
    if not ancestor.is_dir():
        raise ExporterError(f"-o '{output_dir}' cannot be made: '{ancestor}' is a file; choose another -o")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ExporterError(f"-o '{output_dir}' cannot be written: '{ancestor}' is read-only or not ours "
                            "to write in; choose another -o")
    return Destination(output_dir, _state(output_dir))


def _not_from_the_export(package: Path) -> str | None:
    """The first entry of ``package`` its export report does not list (None if all are listed, or
    if there is no report to tell: a package from before reports recorded their files)."""
    from exporter.package.files import REPORT_FILENAME, REPORT_MARKDOWN_FILENAME
    from exporter.package.integrity import recorded_files

    recorded = recorded_files(package)
    if not recorded:
        return None
    written = {name.split("/")[0] for name in recorded} | {REPORT_FILENAME, REPORT_MARKDOWN_FILENAME}
    return next((entry.name for entry in sorted(package.iterdir()) if entry.name not in written), None)


def require_space(destination: Destination, needed_bytes: int) -> None:
    """Raises ExporterError if the disk under ``-o`` has less room than the package needs."""
    ancestor = nearest_existing(destination.path.parent)
    free = shutil.disk_usage(ancestor).free
    if needed_bytes > free:
        raise ExporterError(f"-o '{destination.path}' needs about {size_text(needed_bytes)} and '{ancestor}' "
                            f"has {size_text(free)} free; free some space or choose another -o")


def _state(path: Path) -> tuple | None:
    """What is at ``path``: None, or its inode and every entry below it with inode, size and
    modification time, so that a file added, removed or written anywhere in it shows."""
    try:
        status = path.lstat()
    except FileNotFoundError:
        return None
    entries = []
    for folder, folders, files in os.walk(path):
        for name in folders + files:
            entry = Path(folder, name)
            info = entry.lstat()
            entries.append((entry.relative_to(path).as_posix(), info.st_ino, info.st_size, info.st_mtime_ns))
    return status.st_dev, status.st_ino, tuple(sorted(entries))


@contextlib.contextmanager
def staging_folder(destination: Destination) -> Iterator[Path]:
    """Yields an empty folder beside ``-o``; when the block ends without an exception it replaces
    ``-o``. On any exception (Ctrl-C and SIGTERM included) it is removed, and so are the parent
    folders of ``-o`` it made."""
    path = destination.path
    made = [parent for parent in reversed(path.parents) if not parent.exists()]  # -o's missing parents
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with _locked_staging(destination) as staging:
            yield staging
    except BaseException:
        _remove_empty(made)
        raise


@contextlib.contextmanager
def _locked_staging(destination: Destination) -> Iterator[Path]:
    path = destination.path
    remove_stale_staging(path)
    # .NAME.partial-XXXXXXXX/ holds the lock and package/, the folder that becomes -o.
    root = Path(tempfile.mkdtemp(prefix=f".{path.name}{_STAGING}", dir=path.parent))
    staging, lock = root / "package", None
    try:
        # Locked under another name, then renamed: another export never sees an unlocked lock file.
        lock = open(root / f"{LOCK_NAME}.new", "w")  # noqa: SIM115 (held until the end)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.write(f"{os.getpid()}\n")
        lock.flush()
        os.rename(root / f"{LOCK_NAME}.new", root / LOCK_NAME)
        staging.mkdir(mode=0o777)  # an ordinary folder under the umask, unlike mkdtemp's private one
        yield staging
        _swap_in(staging, destination, root / _PREVIOUS)
    finally:
        # previous/ still there: the old package was not moved back, or not yet deleted after the
        # swap. Either way it is not deleted here: the next export of -o moves it back or, once the
        # swap is known to have happened (package/ gone), deletes it.
        kept = (root / _PREVIOUS).is_dir()
        if not kept:
            shutil.rmtree(staging, ignore_errors=True)  # the package first: the lock marks the folder as ours
        if lock is not None:
            lock.close()
        if not kept:
            shutil.rmtree(root, ignore_errors=True)


def _remove_empty(folders: list[Path]) -> None:
    """Removes the folders the export made for -o's parents, deepest first, where still empty."""
    for folder in reversed(folders):
        try:
            folder.rmdir()
        except OSError:
            return


def remove_stale_staging(path: Path) -> list[Path]:
    """Removes the staging folders of ``path`` left by exports that no longer run (their lock is
    free), first moving back an old package an export killed mid-swap had moved aside; returns
    the folders removed."""
    removed = []
    # Exactly tempfile.mkdtemp's 8-character suffix: `.a.partial-*` would also match the staging
    # folders of a destination named `a.partial-b`.
    own_name = re.compile(re.escape(f".{path.name}{_STAGING}") + r"[a-z0-9_]{8}")
    for candidate in path.parent.glob(f".{glob.escape(path.name)}{_STAGING}*"):
        if not own_name.fullmatch(candidate.name):
            continue
        lock_path = candidate / LOCK_NAME
        if not candidate.is_dir() or candidate.is_symlink() or not lock_path.is_file():
            continue  # not made by this exporter: not ours to delete
        try:
            with open(lock_path) as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # an export still runs there
        previous = candidate / _PREVIOUS
        if previous.is_dir():
            if not (candidate / "package").is_dir() or os.path.lexists(path):
                # The swap's state is unclear, or -o was made anew since: the old package is kept.
                continue
            os.rename(previous, path)  # killed mid-swap: the old package goes back where it was
        shutil.rmtree(candidate, ignore_errors=True)
        removed.append(candidate)
    return removed


# rename's answers when something else now stands at -o.
_TAKEN = {errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR, errno.ENOENT}


def _swap_in(staging: Path, destination: Destination, aside: Path) -> None:
    path = destination.path
    changed = ExporterError(f"-o '{path}' changed while the export ran (created, deleted or written to); "
                            "it was left as it is and nothing was written: run the export again")
    try:
        if destination.state is not None:
            os.rename(path, aside)
            # Still the folder checked up front, and (checked again now) nothing in it the
            # package's own export did not write.
            if _state(aside)[1:] != destination.state[1:] or _not_from_the_export(aside):
                raise changed
        # rename fails on anything that appeared at an absent -o meanwhile, except an empty folder.
        os.rename(staging, path)
    except BaseException as error:
        # Also on Ctrl-C or SIGTERM, even one that lands as a rename returns: moved aside and the
        # new package not in (it is still in staging) means -o goes back as it was.
        if aside.exists() and staging.exists():
            try:
                os.rename(aside, path)
            except OSError as restore_error:
                # Something took -o's place between the two renames: the old package stays aside.
                raise ExporterError(f"-o '{path}' was created again while the export swapped it in; the old "
                                    f"package is kept in '{aside}' and nothing was deleted: move it back "
                                    "yourself") from restore_error
        if isinstance(error, OSError) and error.errno in _TAKEN:
            raise changed from error
        raise
    if destination.state is not None:
        # Renamed first: a previous/ left by an interrupted delete could not be told from an old
        # package kept on purpose, and the cleanup never deletes those.
        superseded = aside.with_name("superseded")
        os.rename(aside, superseded)
        shutil.rmtree(superseded, ignore_errors=True)

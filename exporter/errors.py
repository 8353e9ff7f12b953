"""The one exception type whose message is shown to users as-is, and the environment's errors
(full disk, read-only folder, no permission) said as such rather than as bugs."""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from exporter.units import size_text


class ExporterError(Exception):
    """A problem the user can fix; the message is one line that says what to do."""

    exit_code = 2


class ExporterBug(ExporterError):
    """A step failed in a way no input should cause (a trace or lowering error, a broken
    post-condition): one line too, asking for a report, and exit code 1 as for any bug."""

    exit_code = 1


_ENVIRONMENT = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "not permitted (an immutable or protected path)",
    errno.EEXIST: "it already exists",
    errno.ENAMETOOLONG: "the name is too long for the file system",
    errno.ELOOP: "too many levels of symbolic links",
    errno.EIO: "an input/output error (a failing disk or network file system)",
}


# What numpy's ``tofile`` raises when the disk takes fewer bytes than asked ("32768 requested and
# 31744 written"), with no errno.
_SHORT_WRITE = re.compile(r"\d+ requested and \d+ written")


def environment_error(error: OSError, needed_bytes: int | None = None,
                      where: Path | None = None) -> ExporterError | None:
    """The one-line error for an OSError the machine causes (not a bug), or None for others;
    ``where``: the path to name when the error names none (a write into the package)."""
    number = error.errno
    if number is None and _SHORT_WRITE.search(str(error)):
        number = errno.ENOSPC  # numpy's tofile on a full disk: no errno, only the short count
    reason = _ENVIRONMENT.get(number)
    if reason is None:
        return None
    path = error.filename or where or "?"
    text = f"cannot write or read '{path}': {reason}"
    if number in (errno.ENOSPC, errno.EDQUOT):
        existing = nearest_existing(Path(path))
        facts = [f"the package needs about {size_text(needed_bytes)}"] if needed_bytes else []
        if existing.exists():
            facts.append(f"{size_text(shutil.disk_usage(existing).free)} free there")
        text += (f" ({'; '.join(facts)})" if facts else "") + "; free some space or choose another -o"
    elif number == errno.EEXIST:
        text += "; remove it or choose another -o"
    else:
        # Only a write into the package (``where`` given) is helped by another -o; a checkpoint
        # file that cannot be read is not.
        elsewhere = " or choose another -o" if where is not None else ""
        text += {errno.ENAMETOOLONG: f"; choose a shorter path{elsewhere}",
                 errno.ELOOP: f"; fix the links{elsewhere}",
                 errno.EIO: f"; check the disk{elsewhere}"}.get(number, f"; fix its permissions{elsewhere}")
    return ExporterError(text)


def nearest_existing(path: Path) -> Path:
    """``path`` or its nearest ancestor that exists (where free space and permissions are asked)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def os_error_in(error: Exception, path: Path) -> OSError | None:
    """The OSError behind a library's plain Exception ("... (os error 28)", as Rust code such as
    the tokenizers library says it), or None."""
    found = re.search(r"\(os error (\d+)\)", str(error))
    if found is None:
        return None
    number = int(found.group(1))
    return OSError(number, os.strerror(number), str(path))

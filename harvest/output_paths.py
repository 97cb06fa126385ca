"""Where a command will write: checked before it starts, so that a bad ``--out``,
``--report``, ``--out-dir`` or ``output_dir`` costs seconds and writes nothing, instead of
failing after the work is done.

One rule for every output location: a folder must exist as a folder or be creatable under
the nearest existing part of its path, and writing there must work. It is *tried* (a
folder made and removed at once): permission bits say nothing for root, a read-only mount
or /proc. Standard library only.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

_UNWRITABLE = "cannot be written: "


def folder_problem(path: str | os.PathLike) -> str | None:
    """Why nothing can be written in folder ``path`` (tried in the nearest existing folder
    of its path when it is missing; nothing is left behind); None if it can.
    The text follows the path: ``output_dir: 'x' is a file, not a folder``."""
    path = Path(path).expanduser()
    if path.exists() and not path.is_dir():
        return "is a file, not a folder"
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"lies below {str(existing)!r}, which is a file"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".harvest-write-check-", dir=existing))
    except OSError as exc:
        return f"{_UNWRITABLE}creating a folder in {str(existing)!r} failed ({exc.strerror or exc})"
    return None


def file_problem(path: str | os.PathLike) -> str | None:
    """Why file ``path`` cannot be written (its folder as :func:`folder_problem` tries it);
    None if it can. The text follows the path, as :func:`folder_problem`'s."""
    path = Path(path).expanduser()
    if path.is_dir():
        return "is a folder, not a file"
    problem = folder_problem(path.parent)
    if problem is None:
        return None
    if problem.startswith(_UNWRITABLE):
        return problem
    return f"cannot be written: its folder {str(path.parent)!r} {problem}"

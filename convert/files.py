"""Output files written whole or not at all, with the permissions of any new file (the umask's), and their size."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def umask() -> int:
    """The process's umask (reading it means setting it, so it is set straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_file(path: str | Path, mode: str = "w") -> Iterator:
    """A file open on a temporary sibling of `path`, renamed onto `path` when the block ends without an error (and
    deleted when it raises): readers never see half a file. The file gets a new file's usual mode (0644 under
    umask 022), not mkstemp's 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~umask())
        with os.fdopen(fd, mode) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def normal_modes(folder: str | Path) -> None:
    """Give `folder` and everything under it a new file's usual mode (0644 files, 0755 folders under umask 022),
    since some writers create 0600 files (safetensors 0.8's save_file, mkstemp)."""
    mask = umask()
    for p in [Path(folder), *Path(folder).rglob("*")]:
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def write_json(data, path: str | Path) -> None:
    """`data` as indented JSON at `path`, atomically (see atomic_file); values JSON lacks are written as str()."""
    with atomic_file(path) as f:
        json.dump(data, f, indent=1, default=str)


def disk_bytes(*dirs: str | Path) -> int:
    """Bytes of the files under `dirs` (a missing one counts 0), each file once however the folders nest."""
    files = {f.resolve() for d in map(Path, dirs) if d.is_dir() for f in d.rglob("*") if f.is_file()}
    return sum(f.stat().st_size for f in files)


def format_bytes(n: int) -> str:
    """'45.2 MB', '3.61 GB' (decimal units, as `df -H` and file managers show)."""
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


class DiskSpaceError(OSError):
    """Not enough free space for an output; says how much was needed and how much was free."""


def free_bytes(folder: str | Path) -> int:
    """Free bytes on the file system that holds `folder` (or its nearest existing parent)."""
    path = Path(folder).resolve()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


@contextlib.contextmanager
def room_for(folder: str | Path, needed: int | None, what: str) -> Iterator[None]:
    """Write `what` (about `needed` bytes, None when unknown) into `folder` inside this block: refused up front when
    the file system cannot hold it, and a 'no space left on device' met midway becomes one DiskSpaceError naming
    the space needed (the block's own cleanup has removed the partial output by then)."""
    free = free_bytes(folder)
    if needed is not None and needed > free:
        raise DiskSpaceError(
            errno.ENOSPC,
            f"{what} needs about {format_bytes(needed)} in {folder}, but only {format_bytes(free)} is free there",
        )
    try:
        yield
    except OSError as err:
        if err.errno != errno.ENOSPC or isinstance(err, DiskSpaceError):
            raise
        need = "" if needed is None else f"it needs about {format_bytes(needed)}, "
        raise DiskSpaceError(
            errno.ENOSPC,
            f"no space left on the device while writing {what} into {folder}: {need}"
            f"{format_bytes(free_bytes(folder))} is free now; nothing partial was kept",
        ) from None


def replace_dir(new: str | Path, dst: str | Path) -> None:
    """Put the complete directory `new` at `dst`: `dst` holds the old contents or the new, never a mix of both."""
    new, dst = Path(new), Path(dst)
    if not dst.exists():
        os.replace(new, dst)
        return
    old = dst.parent / f".{dst.name}.old"
    shutil.rmtree(old, ignore_errors=True)
    os.replace(dst, old)
    os.replace(new, dst)
    shutil.rmtree(old, ignore_errors=True)

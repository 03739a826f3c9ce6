"""Output files written whole or not at all, with the permissions of any new file (the umask's), and their size."""

from __future__ import annotations

import contextlib
import errno
import io
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


def write_png(fig, path: str | Path, dpi: float = 110) -> Path:
    """A matplotlib figure written atomically as a PNG (a cut run leaves the old picture or none, never half of one),
    in 256 colours (compact_png)."""
    buffer = io.BytesIO()
    fig.savefig(buffer, dpi=dpi, format="png")
    with atomic_file(path, "wb") as f:
        f.write(compact_png(buffer.getvalue()))
    return Path(path)


def compact_png(data: bytes) -> bytes:
    """A PNG's bytes again with a palette of at most 256 colours and no alpha: a plot's few colours and its
    antialiasing fit one, at a third to a half of the size (pictures travel with every lab run's checkout)."""
    from PIL import Image  # matplotlib's own dependency

    image = Image.open(io.BytesIO(data)).convert("RGB")
    out = io.BytesIO()
    image.quantize(256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(out, "png", optimize=True)
    return out.getvalue()


def mappings() -> list[dict]:
    """This process's memory mappings as /proc/self/smaps lists them, each a dict: start and end (addresses), offset
    (of start in the file), shared (not copied on write), device ("MAJ:MIN", hex), inode, path ("" for none) and its
    kB fields (Rss, Anonymous, Swap, ...) by name. Empty where smaps is missing (not Linux)."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return []
    found = []
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if fields and not fields[0].endswith(":") and "-" in fields[0]:  # start-end perms offset dev inode [path]
            start, end = (int(x, 16) for x in fields[0].split("-"))
            path = fields[5].strip() if len(fields) == 6 else ""
            found.append({"start": start, "end": end, "offset": int(fields[2], 16), "shared": fields[1][3] == "s"})
            found[-1] |= {"device": fields[3], "inode": int(fields[4]), "path": path}
        elif found and len(fields) >= 3 and fields[2] == "kB":
            found[-1][fields[0].rstrip(":")] = int(fields[1])
    return found


def _inodes(dirs) -> dict[tuple[int, int], int]:
    """{(device, inode): size} of the files under `dirs` (missing ones count as empty)."""
    found = {}
    for d in map(Path, dirs):
        for f in d.rglob("*") if d.is_dir() else ():
            if f.is_file():
                st = f.stat()
                found[st.st_dev, st.st_ino] = st.st_size
    return found


def disk_bytes(*dirs: str | Path, besides: tuple = ()) -> int:
    """Bytes the files under `dirs` take (a missing folder counts 0): each file once however the folders nest or
    hard-link to each other, and none that is also a file under `besides` (hard links to it take no more space)."""
    shared = _inodes(besides)
    return sum(size for inode, size in _inodes(dirs).items() if inode not in shared)


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


def check_writable(path: str | Path, name: str, swapped: bool = False) -> None:
    """Refuse, before any work, an output `path` (set by flag or field `name`) that cannot be written: the nearest
    existing folder at or above it must be a folder this process may write in. `swapped`: the output is built
    beside `path` and renamed into place (see replace_dir), so the folder above must be writable too. ValueError
    naming `name`, the path and the folder at fault."""
    path = Path(path).expanduser().absolute()
    for target in (path.parent, path) if swapped else (path,):
        folder = target
        while not folder.exists():
            folder = folder.parent
        if not folder.is_dir():
            raise ValueError(f"{name} {path}: {folder} is a file, not a folder; choose a path in a folder")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ValueError(
                f"{name} {path}: cannot write in {folder} (read-only, or no permission to write there); choose a "
                "folder you can write to"
            )


def link_or_copy(src: str, dst: str) -> None:
    """Hard-link a weights file (never rewritten in place: each writer swaps in a new file), else copy."""
    if src.endswith(".safetensors"):
        with contextlib.suppress(OSError):  # another file system, or links not allowed: copy
            os.link(src, dst)
            return
    shutil.copy2(src, dst)


def copy_dir(src: str | Path, dst: str | Path) -> None:
    """Put a copy of folder `src` at `dst` (replacing it whole, see replace_dir), its weights files hard-linked when
    both lie on one file system, so that they take no more space; the free space needed is checked first."""
    src, dst = Path(src), Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    same_device = os.stat(src).st_dev == os.stat(dst.parent).st_dev
    files = [f for f in src.rglob("*") if f.is_file() and not (same_device and f.suffix == ".safetensors")]
    needed = sum(f.stat().st_size for f in files)
    with room_for(dst.parent, needed, f"the copy of {src} to {dst}"):
        tmp = Path(tempfile.mkdtemp(dir=dst.parent, prefix=f".{dst.name}.partial"))
        try:
            shutil.rmtree(tmp)
            shutil.copytree(src, tmp, copy_function=link_or_copy)
            replace_dir(tmp, dst)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

"""Checkpoints of the training stages (align, train, extend): written atomically, verified, pruned, found again.

    save_checkpoint(out_dir, step, write, {"step": step, ...}, keep=2)   # out_dir/checkpoints/step_{step}
    found = latest_checkpoint(out_dir, warn=print)                       # (path, meta) of the newest good one

A checkpoint is a directory `step_k` (the state after k steps): whatever `write(tmp)` puts there, then
checkpoint.json (the stage's metadata), then, last, manifest.json listing every file with its size and sha256.
The directory is built under a hidden temporary name and renamed into place, so an interruption leaves no
checkpoint at all rather than half of one. A checkpoint whose manifest is missing, unreadable or does not match the
files (truncated weights, corrupt optimizer state, a truncated JSON) is skipped with a warning naming it and what
was wrong, and the previous good one is used. Only the newest `keep` checkpoints stay on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from raven_convert.files import disk_bytes, normal_modes, replace_dir, room_for

CHECKPOINTS = "checkpoints"
META = "checkpoint.json"
MANIFEST = "manifest.json"
LEGACY_META = "stage2.json"  # train checkpoints written before manifests existed: accepted when their JSON reads


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):  # hashlib.file_digest needs Python 3.11
            digest.update(block)
    return digest.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_manifest(folder: Path) -> None:
    """manifest.json of every file under `folder` (flushed to disk first, so a crash cannot leave a manifest that
    vouches for files that never reached it)."""
    files = {}
    for path in _files(folder):
        _fsync(path)
        files[path.relative_to(folder).as_posix()] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    (folder / MANIFEST).write_text(json.dumps({"files": files}, indent=1))
    _fsync(folder / MANIFEST)


def checkpoint_problem(folder: Path) -> str | None:
    """What is wrong with checkpoint `folder` (one phrase naming the file), or None when it is complete and intact."""
    manifest = folder / MANIFEST
    if not manifest.is_file():
        if (folder / LEGACY_META).is_file():
            return _json_problem(folder / LEGACY_META)
        return f"{MANIFEST} is missing (the checkpoint was not finished)"
    problem = _json_problem(manifest)
    if problem:
        return problem
    listed = json.loads(manifest.read_text()).get("files")
    if not isinstance(listed, dict) or META not in listed:
        return f"{MANIFEST} does not list {META}"
    for name, expected in listed.items():
        path = folder / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != expected.get("size"):
            return f"{name} has {size:,} bytes, the manifest says {expected.get('size'):,} (truncated or damaged)"
        if _sha256(path) != expected.get("sha256"):
            return f"{name} does not match its sha256 in the manifest (damaged)"
    return _json_problem(folder / META)


def _json_problem(path: Path) -> str | None:
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        return f"{path.name} is not readable JSON ({err})"
    return None if isinstance(value, dict) else f"{path.name} is not a JSON object"


def _steps(root: Path) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint directory under `root`, newest first."""
    found = [(int(p.name[5:]), p) for p in root.glob("step_*") if re.fullmatch(r"step_\d+", p.name) and p.is_dir()]
    return sorted(found, reverse=True)


def latest_checkpoint(out_dir, warn: Callable[[str], None] | None = None) -> tuple[Path, dict] | None:
    """(directory, metadata) of the newest intact checkpoint in out_dir/checkpoints, or None. Damaged ones are
    skipped; `warn` (if given) is told which, and why."""
    for _, path in _steps(Path(out_dir) / CHECKPOINTS):
        problem = checkpoint_problem(path)
        if problem is None:
            meta = path / (META if (path / META).is_file() else LEGACY_META)
            return path, json.loads(meta.read_text())
        if warn is not None:
            warn(f"warning: skipping damaged checkpoint {path}: {problem}; trying the one before it")
    return None


def prune(root: Path, step: int, keep: int) -> None:
    """Delete every checkpoint in `root` but the newest `keep` up to `step`; any newer than `step` was superseded
    (a run resumed from an older one because they were damaged)."""
    kept = 0
    for s, path in _steps(root):
        if s <= step and kept < keep:
            kept += 1
        else:
            shutil.rmtree(path, ignore_errors=True)


def save_checkpoint(
    out_dir,
    step: int,
    write: Callable[[Path], None],
    meta: dict,
    keep: int,
    main: bool = True,
    barrier: Callable[[], None] = lambda: None,
) -> Path:
    """Build out_dir/checkpoints/step_{step}: `write(folder)` fills it (on every process, between `barrier`s, when
    several save their parts), then the main process adds checkpoint.json (`meta`) and the manifest, renames the
    folder into place and prunes to the newest `keep`. Returns the checkpoint's path."""
    root = Path(out_dir) / CHECKPOINTS
    final, tmp = root / f"step_{step}", root / f".tmp_step_{step}"
    previous = _steps(root)
    needed = disk_bytes(previous[0][1]) if previous else None  # about the size of the last one
    with room_for(root, needed, f"the step-{step} checkpoint"):
        _save(final, tmp, step, write, meta, keep, main, barrier)
    return final


def _save(final: Path, tmp: Path, step: int, write, meta: dict, keep: int, main: bool, barrier) -> None:
    """save_checkpoint's work: build `tmp`, then swap it in as `final`."""
    root = final.parent
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    try:
        barrier()
        write(tmp)
        barrier()
        if main:
            (tmp / META).write_text(json.dumps(meta, indent=1, default=str))
            _write_manifest(tmp)
            normal_modes(tmp)  # safetensors writes 0600 files
            replace_dir(tmp, final)
            prune(root, step, keep)
        barrier()
    except BaseException:  # a failure or Ctrl-C while saving leaves no half-written checkpoint directory
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

"""Helpers of the fault tests (test_faults.py, test_faults_stages.py): the one line a user error prints, a tiny
recipe on a copy of a converted run, and a function made to fail at its n-th call."""

import shutil
from pathlib import Path

import yaml


def one_line(text: str) -> str:
    """The single line a user error prints (no traceback)."""
    assert "Traceback" not in text
    lines = [line for line in text.splitlines() if line.strip()]
    assert lines, "nothing was printed"
    return lines[-1]


def recipe_data(source: Path, data: Path, **sections) -> dict:
    return {
        "source": str(source),
        "layers": [{"mixer": "raven", "layers": "1"}],
        "mixer_settings": {"raven": {"num_slots": 8, "top_k": 2}},
        "dtype": "float32",
        "data": {"source": str(data), "seq_len": 32, "validation_fraction": 0.1},
        **sections,
    }


def prepare(converted: dict, tmp_path: Path, **sections) -> tuple[list[str], Path]:
    """A copy of the converted run and a recipe file with `sections`: (argv of raven_convert.train, run dir)."""
    run = tmp_path / "run"
    shutil.copytree(converted["run"], run)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe_data(converted["source"], converted["data"], **sections)))
    return [str(path), "--run-dir", str(run)], run


def fail_at(monkeypatch, module, name: str, call: int, make, counted=lambda: True):
    """Replace module.name so that its `call`-th counted call returns make(result) (or raises what make raises)."""
    original, calls = getattr(module, name), []

    def patched(*args, **kwargs):
        result = original(*args, **kwargs)
        if counted():
            calls.append(1)
            if len(calls) == call:
                return make(result)
        return result

    monkeypatch.setattr(module, name, patched)


def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def checkpoints(run: Path, stage: str) -> list[str]:
    folder = run / stage / "checkpoints"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def left_behind(*folders: Path) -> list[Path]:
    """Hidden temporaries (.tmp_step_*, .X.partial*, .X.old, .name.*.tmp) anywhere under `folders`; not the
    `.metadata` index of a torch.distributed.checkpoint folder (train and extend checkpoints)."""
    return [p for folder in folders for p in folder.rglob(".*") if p.name != ".metadata"]

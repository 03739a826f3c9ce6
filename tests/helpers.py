"""Test helpers: the packages the toolkit installs, a tiny text corpus, code run where transformers is importable
but this toolkit is not (as on a machine that only downloads a model), and the comparison of two training runs that
differ in rounding (assert_same_updates, assert_same_losses)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import tomllib

REPO = Path(__file__).resolve().parents[1]
SETUPTOOLS = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
PACKAGES = SETUPTOOLS["packages"]  # ["raven_convert", "raven_convert.evaluate", ...]
TOOLKIT_PACKAGES = sorted({name.split(".")[0] for name in PACKAGES})  # the top-level import names
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jolly big mice".split()


def package_folder(package: str) -> Path:
    """The folder of the repository that installs as `package`."""
    top, *rest = package.split(".")
    return REPO / SETUPTOOLS["package-dir"].get(top, top) / Path(*rest)


def corpus(folder: Path) -> Path:
    """folder/docs.jsonl: six documents of a few hundred characters (about 70 rows of 32 characters)."""
    folder.mkdir()
    docs = [" ".join(WORDS[i:] + WORDS[:i]) * (i + 2) for i in range(6)]
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return folder


def words_corpus(folder: Path, documents: int = 20, words_per_document: int = 60) -> Path:
    """folder/docs.jsonl: `documents` documents over 80 made-up words (the retrieval samples and the layer choice's
    probes need at least 32 distinct ones). Returns the folder."""
    import random

    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnop") for _ in range(rng.randint(4, 8))) for _ in range(80)]
    docs = [" ".join(rng.choice(words) for _ in range(words_per_document)) + "." for _ in range(documents)]
    (folder / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return folder


def read_weights(folder: Path) -> dict:
    """{name: tensor} of a model directory's weights: the safetensors files its index lists, or model.safetensors."""
    from safetensors.torch import load_file

    index = folder / "model.safetensors.index.json"
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.is_file() else {"model.safetensors"}
    return {name: tensor for file in sorted(files) for name, tensor in load_file(folder / file).items()}


def site_packages() -> list[str]:
    """The site-packages directories this interpreter imports from, in order: a venv's own first, then any it links
    to (scripts/dev/test_oldest_transformers.sh links the test environment's after an older transformers)."""
    return [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]


def run_python(code: str, cwd: Path, env: dict[str, str], flags: tuple[str, ...] = ()) -> dict:
    """Run `code` in a fresh interpreter (started with `flags`, under `env`, offline, with its own module cache for
    the code models carry) in `cwd`.

    The snippet sees `result` (a dict) and whatever it stores there is returned, and `output_cache(out)`, the cache
    of a model or generate() output under the installed transformers' field name.
    """
    prelude = textwrap.dedent(
        """
        import importlib.util, json, sys
        result = {}
        def output_cache(out):
            return out["cache"] if "cache" in out else out["past_key_values"]
        """
    )
    result_file = cwd / "isolated_result.json"
    epilogue = f"\nopen({str(result_file)!r}, 'w').write(json.dumps(result))\n"
    env = env | {"HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(cwd / "hf_modules"), "TRANSFORMERS_VERBOSITY": "error"}
    proc = subprocess.run(
        [sys.executable, *flags, "-c", prelude + textwrap.dedent(code) + epilogue],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"isolated process failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(result_file.read_text())


def run_without_toolkit(code: str, cwd: Path) -> dict:
    """`run_python` with `python -S` (no .pth files, so no editable install) and only site-packages on the path. It
    first proves that none of the toolkit's packages can be imported."""
    guard = textwrap.dedent(
        f"""
        visible = [name for name in {TOOLKIT_PACKAGES!r} if importlib.util.find_spec(name) is not None]
        assert not visible, f"toolkit packages importable in the isolated process: {{visible}}"
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    env["PYTHONPATH"] = os.pathsep.join(site_packages())
    return run_python(guard + textwrap.dedent(code), cwd, env, flags=("-S",))


def assert_same_updates(
    weights: dict, reference: dict, initial: dict, share: float = 0.02, rounding: dict | None = None
):
    """Each trained tensor's update (from `initial`) is the reference run's within `share` of its size, plus twice
    the gap `rounding` (a run of the same steps that differs from the reference in rounding alone) leaves. Adam
    moves a tensor whose gradient is rounding noise by about lr whatever its sign, so elementwise tolerances fail on
    bf16 rounding alone; a missed or doubled update moves a tensor by ~100% of its update."""
    for name, value in reference.items():
        update, gap = (value - initial[name]).norm(), (weights[name] - value).norm()
        floor = 0.0 if rounding is None else float((rounding[name] - value).norm())
        assert update > 0, f"{name} did not train"
        assert gap <= share * update + 2 * floor, (
            f"{name}: {gap:.3g} from the reference run, whose update is {update:.3g}; another rounding: {floor:.3g}"
        )


def assert_same_losses(losses: list, reference: list, rounding: list, rel: float = 2e-3):
    """Each step's loss is the reference run's within `rel`, plus twice the gap of `rounding` (a run that differs
    from the reference in rounding alone) at that step."""
    for step, (value, expected, other) in enumerate(zip(losses, reference, rounding, strict=True)):
        allowed = rel * abs(expected) + 2 * abs(other - expected)
        assert abs(value - expected) <= allowed, (
            f"step {step}: loss {value} against {expected} (another rounding: {other})"
        )

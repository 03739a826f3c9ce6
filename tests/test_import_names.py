"""The import names the toolkit installs belong to it: the folders convert/ and kernels/ install as raven_convert and
raven_kernels (pyproject.toml), so Hugging Face's `kernels` keeps its import name, and transformers finds it (or
nothing) under `kernels`. scripts/dev/check_hub_kernels.sh installs both distributions into one environment."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
from importlib.metadata import PackageNotFoundError, distribution, packages_distributions
from pathlib import Path

import pytest

from tests.helpers import PACKAGES, REPO, TOOLKIT_PACKAGES, package_folder


def test_every_top_level_name_is_the_projects_own():
    assert TOOLKIT_PACKAGES == ["raven_convert", "raven_kernels", "raven_layers"]
    assert all(name.startswith("raven_") for name in TOOLKIT_PACKAGES)


def test_every_package_folder_is_installed():
    # pyproject.toml lists the packages (a folder installed under another name cannot be found by name)
    listed = {package_folder(name) for name in PACKAGES}
    on_disk = {init.parent for top in TOOLKIT_PACKAGES for init in package_folder(top).rglob("__init__.py")}
    assert listed == on_disk, f"missing from pyproject.toml: {sorted(map(str, on_disk - listed))}"


def test_the_installed_distribution_claims_only_those_names():
    try:
        distribution("raven-hybrid")
    except PackageNotFoundError:
        pytest.skip("raven-hybrid is not installed (a checkout on the import path)")
    ours = sorted(name for name, dists in packages_distributions().items() if "raven-hybrid" in dists)
    assert ours == TOOLKIT_PACKAGES


def test_transformers_sees_no_kernels_package_of_ours(tmp_path):
    # a fresh interpreter outside the checkout (whose folder kernels/ would be importable as `kernels` from there):
    # transformers probes `kernels` once per process
    code = textwrap.dedent(
        """
        import importlib.metadata, importlib.util, json
        import raven_kernels
        from transformers.utils.import_utils import _is_package_available
        spec = importlib.util.find_spec("kernels")
        print(json.dumps({"ours": raven_kernels.__file__, "kernels": spec and spec.origin,
                          "seen": _is_package_available("kernels", return_version=True),
                          "owners": importlib.metadata.packages_distributions().get("kernels", [])}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, check=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(result["ours"]).resolve() == REPO / "kernels" / "__init__.py"
    assert "raven-hybrid" not in result["owners"]
    if result["kernels"] is None:
        assert result["seen"] == [False, "N/A"]
    else:  # Hugging Face's, installed beside the toolkit
        assert not Path(result["kernels"]).resolve().is_relative_to(REPO) and result["owners"] == ["kernels"]


def test_a_checkout_gets_the_installed_names_from_device_env(tmp_path):
    # what the device scripts do in a checkout that is not installed: source scripts/device_env.sh
    for name in ("convert", "kernels", "raven_layers"):
        (tmp_path / name).symlink_to(REPO / name)
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "device_env.sh", tmp_path / "scripts")
    names = TOOLKIT_PACKAGES
    code = f"import importlib.util as u, json; print(json.dumps({{n: u.find_spec(n).origin for n in {names}}}))"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    command = ["bash", "-c", 'source scripts/device_env.sh && "$0" -S -c "$1"', sys.executable, code]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, env=env, check=True)
    origins = json.loads(proc.stdout)
    assert {name: Path(origin).resolve() for name, origin in origins.items()} == {
        name: package_folder(name) / "__init__.py" for name in TOOLKIT_PACKAGES
    }
    assert all((tmp_path / ".packages" / Path(*name.split(".")) / "__init__.py").is_file() for name in PACKAGES)

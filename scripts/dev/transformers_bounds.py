"""Helpers of scripts/dev/test_oldest_transformers.sh and scripts/lab/newest_transformers.sh.

python scripts/dev/transformers_bounds.py --oldest                    # prints 5.17: pyproject.toml's lower bound
python scripts/dev/transformers_bounds.py --requirement               # prints transformers>=5.17,<6
python scripts/dev/transformers_bounds.py --link-site-packages VENV   # VENV reads this interpreter's site-packages
"""

from __future__ import annotations

import argparse
import re
import site
import sys
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def transformers_requirement(text: str) -> str:
    """The `transformers` requirement of a pyproject.toml's text, as pip takes it."""
    match = re.search(r'"(transformers\s*[<>=!~][^"]*)"', text)
    if match is None:
        raise SystemExit(f"{PYPROJECT} declares no transformers requirement")
    return match.group(1).replace(" ", "")


def oldest_transformers(text: str) -> str:
    """The lower bound of the `transformers` requirement in a pyproject.toml's text."""
    match = re.search(r">=([0-9][0-9.]*)", transformers_requirement(text))
    if match is None:
        raise SystemExit(f"{PYPROJECT} declares no lower bound for transformers (expected 'transformers>=X.Y')")
    return match.group(1)


def link_site_packages(venv: Path) -> Path:
    """Make `venv` read this interpreter's site-packages (and their .pth files: editable installs) after its own.

    Unlike `venv --system-site-packages`, this works from inside another venv too.
    """
    targets = sorted((venv / "lib").glob("python*/site-packages"))
    if not targets:
        raise SystemExit(f"{venv} is not a virtual environment: no lib/python*/site-packages")
    parents = [p for p in site.getsitepackages() if Path(p).is_dir()]
    pth = targets[0] / "zz_parent_environment.pth"  # read after the venv's own packages
    pth.write_text("".join(f"import site; site.addsitedir({p!r})\n" for p in parents))
    return pth


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--oldest", action="store_true", help="print the oldest transformers release accepted")
    group.add_argument("--requirement", action="store_true", help="print the transformers requirement")
    group.add_argument("--link-site-packages", type=Path, metavar="VENV")
    args = parser.parse_args(argv)
    if args.oldest:
        print(oldest_transformers(PYPROJECT.read_text()))
    elif args.requirement:
        print(transformers_requirement(PYPROJECT.read_text()))
    else:
        link_site_packages(args.link_site_packages)


if __name__ == "__main__":
    main(sys.argv[1:])

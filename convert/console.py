"""What the console commands share: how the user invoked them, and the one line printed on Ctrl-C."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

INTERRUPTED = 130  # the shell's exit status for a command ended by SIGINT


def invoked_as(module: str, scripts: tuple[str, ...]) -> str:
    """The program name to repeat in a command line: the console script the user ran, or `python -m module`."""
    name = Path(sys.argv[0]).name
    return name if name in scripts else f"python -m {module}"


def command_line(program: str, args: list[str]) -> str:
    """A command the user can paste into a shell."""
    return " ".join([program, *map(shlex.quote, args)])


def interrupted(saved: str, resume: str) -> int:
    """Report a Ctrl-C in one line (what was saved, the command that resumes) and return the exit status."""
    print(f"interrupted: {saved}. To resume: {resume}", file=sys.stderr, flush=True)
    return INTERRUPTED

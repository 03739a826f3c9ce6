"""What the console commands share: how the user invoked them, progress lines' ETA, and the one line printed on
Ctrl-C (by one process of a multi-process launch)."""

from __future__ import annotations

import math
import os
import re
import shlex
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

INTERRUPTED = 130  # the shell's exit status for a command ended by SIGINT


def invoked_as(module: str, scripts: tuple[str, ...]) -> str:
    """The program name to repeat in a command line: the console script the user ran, or `python -m module`."""
    name = Path(sys.argv[0]).name
    return name if name in scripts else f"python -m {module}"


def command_line(program: str, args: list[str]) -> str:
    """A command the user can paste into a shell."""
    return " ".join([program, *map(shlex.quote, args)])


def is_main_process() -> bool:
    """Whether this is the process that writes files and talks to the user (RANK 0 under accelerate launch or
    torchrun; the only process otherwise)."""
    return int(os.environ.get("RANK", "0")) == 0


def eta(seconds: float) -> str:
    """The time left, for a progress line: 'ETA 1h02m03s', 'ETA 4m05s', 'ETA 12s', 'ETA <1s', 'done' when nothing
    is left (exactly 0) and 'ETA ?' when it cannot be told. Never 'ETA 0s', which reads as finished or stalled."""
    if not math.isfinite(seconds) or seconds < 0:
        return "ETA ?"
    if seconds == 0:
        return "done"
    if seconds < 1:
        return "ETA <1s"
    s = round(seconds)
    if s >= 3600:
        return f"ETA {s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"
    return f"ETA {s // 60}m{s % 60:02d}s" if s >= 60 else f"ETA {s}s"


@contextmanager
def reporting_interrupt():
    """Around the handling of a Ctrl-C: further SIGINTs are ignored until it is reported. torchrun sends its
    workers a second SIGINT as it stops them, which would otherwise break into the report with a traceback."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def interrupted(saved: str, resume: str) -> int:
    """Report a Ctrl-C in one line (what was saved, the command that resumes) and return the exit status. Under a
    multi-process launch every process gets the SIGINT; only the main one prints."""
    if is_main_process():
        print(f"interrupted: {saved}. To resume: {resume}", file=sys.stderr, flush=True)
    return INTERRUPTED


def attach_negative_values(argv: list[str]) -> list[str]:
    """argv with a value such as `-1k` joined to the option before it (`--lengths=-1k`): argparse reads a token that
    starts with '-' and is not a plain number as another option and says only 'expected one argument', where the
    option's own check names the value and what is allowed."""
    out = []
    for word in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and re.match(r"-\d", word):
            out[-1] = f"{out[-1]}={word}"
        else:
            out.append(word)
    return out

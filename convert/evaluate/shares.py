"""Evaluation on the processes of a launch: each process runs its share of the work on its own device, and every
process gets the results in the order a single process makes them.

    answers = spread(batches, run_batches, parallel)   # run_batches(batches[rank::world]) here; all, in order

`parallel` is anything with rank, world, is_main, device (None: the request's) and gather(value) -> every process's
value in process order: the recipe pipeline passes its raven_convert.train.distributed.Parallel (evaluate does not
import the training side), `raven-eval` runs as OneProcess.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class OneProcess:
    """No launch: this process does all the work."""

    rank, world, is_main, device = 0, 1, True, None

    def gather(self, value: object) -> list:
        return [value]


def spread(items: Sequence, work: Callable[[Sequence], list], parallel) -> list:
    """work(items[rank::world]) on this process (one result per item), and every process's results in the order of
    `items`, on every process. Strided shares keep the processes evenly loaded when the items are sorted by cost
    (retrieval's batches by length). An error on one process is raised on all, so none waits at a gather the failed
    one never reaches."""
    if parallel.world == 1:
        return list(work(items))
    try:
        mine = ("ok", list(work(items[parallel.rank :: parallel.world])))
    except Exception as err:  # raised below on every process, with the other processes' errors
        mine = ("error", f"{type(err).__name__}: {err}")
    parts = parallel.gather(mine)
    errors = [f"process {rank}: {value}" for rank, (kind, value) in enumerate(parts) if kind == "error"]
    if errors:
        raise RuntimeError("; ".join(errors))
    results = [None] * len(items)
    for rank, (_, values) in enumerate(parts):
        results[rank :: parallel.world] = values
    return results

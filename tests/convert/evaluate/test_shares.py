"""spread: each process's strided share of the items, the results back in the order of the items on every process,
and one process's error raised on all; processes played by threads that swap values at a barrier."""

import threading
from types import SimpleNamespace

import pytest

from raven_convert.evaluate.shares import OneProcess, spread


def on_threads(world: int, run) -> list:
    """run(parallel) on `world` threads standing in for the processes of a launch; what each returned or raised."""
    board, meeting, outcome = [None] * world, threading.Barrier(world, timeout=10), [None] * world

    def gather(rank: int, value: object) -> list:
        board[rank] = value
        meeting.wait()
        values = list(board)
        meeting.wait()  # nobody overwrites the board before every thread has read it
        return values

    def member(rank: int) -> None:
        parallel = SimpleNamespace(rank=rank, world=world, is_main=rank == 0, device=None)
        parallel.gather = lambda value: gather(rank, value)
        try:
            outcome[rank] = run(parallel)
        except Exception as err:
            outcome[rank] = err

    threads = [threading.Thread(target=member, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcome


@pytest.mark.parametrize("world", [2, 3, 7])
def test_uneven_shares_come_back_in_order_on_every_process(world):
    items, shares = list("abcde"), {}

    def work(parallel):
        def upper(share):
            shares[parallel.rank] = list(share)
            return [x.upper() for x in share]

        return spread(items, upper, parallel)

    assert on_threads(world, work) == [list("ABCDE")] * world
    assert shares == {rank: items[rank::world] for rank in range(world)}  # 5 over 2: [a, c, e] and [b, d]
    assert spread(items, lambda share: [x.upper() for x in share], OneProcess()) == list("ABCDE")


def test_an_error_on_one_process_is_raised_on_all():
    def work(parallel):
        def fail_on_one(share):
            if parallel.rank == 1:
                raise ValueError("out of prompts")
            return list(share)

        return spread(range(4), fail_on_one, parallel)

    outcome = on_threads(2, work)
    assert all(isinstance(err, RuntimeError) and str(err) == "process 1: ValueError: out of prompts" for err in outcome)

"""Several training processes as threads of this one, for the code that shares a job between them (a
:class:`~specdec.train.process_team.Team` each): ``exchange`` gives every thread's object in thread order."""
from __future__ import annotations

import threading
from collections.abc import Callable

from specdec.train.process_team import Team


def run_as_team(n: int, job: Callable[[Team], object]) -> list:
    """``job(team)`` in ``n`` threads, one team member each; returns what each returned or raised (in thread order).
    Once a thread has raised, the others' next exchange raises KeyboardInterrupt, as processes stop together at
    their next meeting after one was interrupted (train/agreed_interrupts.py); an exchange all of them made before
    returns as usual."""
    cond, board, made_by, failed, results = threading.Condition(), {}, [0] * n, [], [None] * n

    def member(r: int) -> Team:
        def exchange(made):
            with cond:
                k, made_by[r] = made_by[r], made_by[r] + 1
                board.setdefault(k, {})[r] = made
                cond.notify_all()
                if not cond.wait_for(lambda: len(board[k]) == n or failed, timeout=120):
                    raise TimeoutError(f"thread {r} waited 120 s for exchange {k}")
                if len(board[k]) < n:
                    raise KeyboardInterrupt(f"thread {failed[0]} stopped")
                return [board[k][i] for i in range(n)]

        def meet() -> None:
            exchange(None)

        return Team(r, n, meet, exchange)

    def run(r: int) -> None:
        try:
            results[r] = job(member(r))
        except BaseException as err:  # noqa: BLE001 - handed to the test, KeyboardInterrupt included
            results[r] = err
            with cond:
                failed.append(r)
                cond.notify_all()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results

"""runtime.session helpers."""

import threading

import pytest

from specdecode.runtime.session import on_passing_thread


def test_on_passing_thread_runs_on_a_thread_that_ends():
    seen = []
    assert on_passing_thread(lambda: seen.append(threading.current_thread()) or 7) == 7
    assert seen[0] is not threading.main_thread() and not seen[0].is_alive()  # its OpenMP team is gone

    def fail():
        raise ValueError("bad model path")

    with pytest.raises(ValueError, match="bad model path"):  # errors reach the caller as they were
        on_passing_thread(fail)

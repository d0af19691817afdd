"""The event loop before the models (gateway/server/priority.py): every other thread of the
process runs at a lower CPU priority, the caller's (the loop's) is unchanged."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.helpers import ROOT

CHECK = textwrap.dedent(
    """
    import os, threading
    from pathlib import Path
    from gateway.server.priority import lower_other_threads, lower_this_thread

    if not Path("/proc/self/task").is_dir():  # threads have no priority of their own
        assert lower_other_threads(3) == 0
        print("ok")
        raise SystemExit

    started, done = threading.Event(), threading.Event()
    tids = []

    def work():
        tids.append(threading.get_native_id())
        started.set()
        done.wait()

    thread = threading.Thread(target=work)
    thread.start()
    started.wait()
    before = os.getpriority(os.PRIO_PROCESS, tids[0])
    own = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert lower_other_threads(3) == 1
    assert os.getpriority(os.PRIO_PROCESS, tids[0]) == min(before + 3, 19)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == own
    assert lower_other_threads(0) == 0
    done.set()
    thread.join()

    # A compute thread started later by the caller lowers itself as far.
    def later():
        lower_this_thread()
        tids.append(threading.get_native_id())
        tids.append(os.getpriority(os.PRIO_PROCESS, tids[-1]))

    thread = threading.Thread(target=later)
    thread.start()
    thread.join()
    assert tids[-1] == min(own + 3, 19), tids
    print("ok")
    """
)


def test_every_other_thread_is_lowered_and_the_callers_is_not() -> None:
    # In a child process: lowering the test runner's own threads would outlive the test.
    out = subprocess.run(
        [sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"

"""``python -m tests.helpers.child_probe [exit N | sleep S | raise | pool]``: prints what the
process sees (argv, folder, environment, its module spec, a draw of ``random``, the signals it
ignores, whether it leads its session, its parent) for tests of
:func:`tests.conftest.run_module` and :func:`tests.conftest.start_module`, then exits with N,
after S seconds, by an exception, or with a thread pool left running (as torch.compile leaves its
own)."""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time

if __name__ == "__main__":
    what = sys.argv[1:]
    if what[:1] == ["sleep"]:
        time.sleep(float(what[1]))
    if what[:1] == ["pool"]:
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(2)  # kept: a pool no longer referenced ends its threads
        pool.submit(time.sleep, 0).result()
    if what[:1] == ["raise"]:
        raise RuntimeError("raised in the child")
    print(json.dumps({"argv": sys.argv, "cwd": os.getcwd(), "env": dict(os.environ),
                      "spec": __spec__.name, "random": random.random(),
                      "threads": threading.active_count(),
                      "ignored": sorted(s.name for s in signal.valid_signals()
                                        if signal.getsignal(s) is signal.SIG_IGN),
                      "leader": os.getsid(0) == os.getpid(), "parent": os.getppid()}))
    print("to stderr", file=sys.stderr)
    sys.exit(int(what[1]) if what[:1] == ["exit"] else 0)

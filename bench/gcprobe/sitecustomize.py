"""The garbage collector's pauses in every Python process started with this folder on PYTHONPATH (Python
imports `sitecustomize` at start-up): each collection's wall time, generation and what it freed, written at
exit to $GC_PROBE_OUT/gc.<pid>.json with the process's command line. For the services under load:

    GC_PROBE_OUT=/tmp/gc PYTHONPATH=bench/gcprobe python -m bench.services_bench ...   # the stacks inherit it
    python -m bench.gcprobe.summary /tmp/gc --log DIR/services.log   # pauses per round in each load window

Not imported by anything else; without GC_PROBE_OUT it does nothing."""

import atexit
import gc
import json
import os
import sys
import time

_out = os.environ.get("GC_PROBE_OUT")
if _out:
    _started: list[float] = [0.0]
    _events: list[tuple[float, int, float, int]] = []  # (wall clock at the end, generation, seconds, collected)

    def _on_collection(phase: str, info: dict) -> None:
        now = time.perf_counter()
        if phase == "start":
            _started[0] = now
        else:
            _events.append((time.time(), info["generation"], now - _started[0], info["collected"]))

    def _write() -> None:
        os.makedirs(_out, exist_ok=True)
        with open(os.path.join(_out, f"gc.{os.getpid()}.json"), "w") as f:
            json.dump({"argv": sys.argv[:3], "frozen": gc.get_freeze_count(), "events": _events}, f)

    gc.callbacks.append(_on_collection)
    atexit.register(_write)

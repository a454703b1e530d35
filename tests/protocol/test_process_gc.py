"""The step loops' collector settings: rare collections, start-up's objects frozen out of every collection."""

from __future__ import annotations

import subprocess
import sys

from infer_protocol.process_gc import GC_THRESHOLDS


def test_tune_gc_freezes_start_up_and_raises_the_thresholds() -> None:
    code = ("import gc; from infer_protocol.process_gc import tune_gc; junk = [[i] for i in range(5000)]; "
            "assert gc.get_freeze_count() == 0; tune_gc(); print(gc.get_threshold(), gc.get_freeze_count())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(")")
    assert out[0] + ")" == str(GC_THRESHOLDS)
    assert int(out[1]) >= 5000  # the start-up lists are frozen
    assert GC_THRESHOLDS[0] > 700  # above the default: not a collection every step

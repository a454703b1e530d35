"""bench/torch_profile.py's device timeline: busy time as the union over streams, idle gaps, per-stream totals."""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench.scripts import load_bench_script

torch_profile = load_bench_script("torch_profile")


def _kernel(ts: float, dur: float, stream: int, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": "k", "ts": ts, "dur": dur, "tid": stream, "args": {"stream": stream}}


def test_overlapping_streams_count_once_and_gaps_are_the_idle_rest(tmp_path: Path) -> None:
    # stream 7: 0-10 and 30-40; stream 13: 5-20 (under the first), then a memcpy 41-42 after a 1 us gap; a host op
    # event (cat cpu_op) spanning everything is not device work
    events = [_kernel(0, 10, 7), _kernel(5, 15, 13), _kernel(30, 10, 7), _kernel(41, 1, 7, "gpu_memcpy"),
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": -5, "dur": 100, "tid": 1}]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    summary = torch_profile.device_timeline(trace)
    assert summary["span_us"] == 42
    assert summary["busy_us"] == 20 + 10 + 1  # 0-20 (two streams), 30-40, 41-42
    assert summary["idle_us"] == 11
    assert summary["gaps_over_2us"] == 1 and summary["gaps_over_2us_total_us"] == 10  # 20-30; the 1 us gap is not
    assert summary["stream_busy_us"] == {"7": 21, "13": 15}
    assert summary["events"] == 4
    assert summary["step_spans_us"] == [42]  # no idle stretch long enough to end a step


def test_idle_stretches_past_the_step_gap_split_the_steps(tmp_path: Path) -> None:
    # two steps of a bench loop: 0-50 (two kernels, a 5 us gap inside), then the host's 300 us, then 350-420; the
    # second step's input copy went out alone at 200 (not a step)
    events = [_kernel(0, 20, 7), _kernel(25, 25, 7), _kernel(200, 4, 7, "gpu_memcpy"), _kernel(350, 70, 7)]
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": events}))
    summary = torch_profile.device_timeline(trace)
    assert summary["step_spans_us"] == [50, 70]
    assert summary["gaps_over_2us"] == 1 and summary["gaps_over_2us_total_us"] == 5  # the host's gaps are not a step's
    assert summary["span_us"] == 420 and summary["busy_us"] == 119


def test_a_trace_without_device_work_has_an_empty_timeline(tmp_path: Path) -> None:
    trace = tmp_path / "trace.json"
    trace.write_text(json.dumps({"traceEvents": [{"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 5, "tid": 1}]}))
    assert torch_profile.device_timeline(trace) == {}

"""bench/itl_gaps.py: a sweep's long inter-token gaps classed by cause, on timelines whose causes are known."""

from __future__ import annotations

from tests.bench.scripts import load_bench_script

itl_gaps = load_bench_script("itl_gaps")
STEP = 0.003


def _stream(sent: float, gaps: list[float]) -> dict:
    return {"sent": sent, "ttft": 0.010, "itl": gaps}


def test_a_gap_with_another_requests_first_token_inside_is_beside_its_prefill() -> None:
    # A and B decode every 3 ms from t = 0.010; the step from 0.037 to 0.043 is 6 ms long: C's prompt ran in it,
    # and C's first token came with that step's end
    a = _stream(0.0, [STEP] * 9 + [2 * STEP] + [STEP] * 10)
    b = _stream(0.0, [STEP] * 9 + [2 * STEP] + [STEP] * 10)
    c = _stream(0.030, [STEP] * 10)
    c["ttft"] = 0.043 - 0.030
    report = itl_gaps.classify([a, b, c], factor=1.5)
    assert report["long"] == 2 and report["beside_prefill"] == 2
    assert report["shared"] == report["alone"] == 0
    assert abs(report["median_ms"] - 3.0) < 1e-6


def test_a_stall_every_stream_sees_at_once_is_shared() -> None:
    a = _stream(0.0, [STEP] * 5 + [4 * STEP] + [STEP] * 5)
    b = _stream(0.0002, [STEP] * 5 + [4 * STEP] + [STEP] * 5)  # the same step, read 0.2 ms later
    report = itl_gaps.classify([a, b], factor=2.0)
    assert (report["long"], report["shared"], report["beside_prefill"], report["alone"]) == (2, 2, 0, 0)


def test_a_gap_one_stream_alone_sees_is_alone() -> None:
    a = _stream(0.0, [STEP] * 5 + [4 * STEP, 0.0001] + [STEP] * 5)  # two tokens read together, late
    b = _stream(0.0, [STEP] * 12)
    report = itl_gaps.classify([a, b], factor=2.0)
    assert (report["long"], report["alone"], report["shared"], report["beside_prefill"]) == (1, 1, 0, 0)
    assert "alone 100 %" in itl_gaps.describe(report)


def test_a_requests_own_first_token_does_not_explain_its_gap() -> None:
    a = _stream(0.0, [4 * STEP] + [STEP] * 8)  # its first gap: its own first token opens it, no other request
    report = itl_gaps.classify([a], factor=2.0)
    assert (report["long"], report["alone"]) == (1, 1)


def test_no_gaps() -> None:
    report = itl_gaps.classify([_stream(0.0, [])])
    assert report["gaps"] == 0 and report["long"] == 0
    assert itl_gaps.describe(itl_gaps.classify([_stream(0.0, [STEP] * 4)])).startswith("no gap above")

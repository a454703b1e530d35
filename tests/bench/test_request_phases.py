"""bench/request_phases.py: the phase means between two /metrics texts, on texts with known sums."""

from __future__ import annotations

import pytest

from tests.bench.scripts import load_bench_script

request_phases = load_bench_script("request_phases")


def _text(count: int, sums: dict[str, float]) -> str:
    lines = []
    for key, name in request_phases.PHASES.items():
        lines += [f"# TYPE {name} histogram", f'{name}_bucket{{le="+Inf"}} {count}', f"{name}_count {count}",
                  f"{name}_sum {sums[key]}"]
    return "\n".join(lines) + "\n"


def test_the_means_are_over_the_requests_between_the_scrapes() -> None:
    before = request_phases.parse(_text(4, {"ttft": 1.0, "queue": 0.5, "prefill": 0.25, "decode": 8.0}))
    # two more requests: TTFT 30 ms each, of which queue 5 and prefill 20; decode 1.5 s each
    after = request_phases.parse(_text(6, {"ttft": 1.06, "queue": 0.51, "prefill": 0.29, "decode": 11.0}))
    means = request_phases.means_ms(before, after)
    assert means["ttft"] == pytest.approx(30.0) and means["queue"] == pytest.approx(5.0)
    assert means["prefill"] == pytest.approx(20.0) and means["hops"] == pytest.approx(5.0)
    assert means["decode"] == pytest.approx(1500.0)
    assert "hops 5.00" in request_phases.describe(means)


def test_no_report_without_the_histograms_or_without_requests() -> None:
    text = _text(4, {"ttft": 1.0, "queue": 0.5, "prefill": 0.25, "decode": 8.0})
    assert request_phases.means_ms(request_phases.parse(text), request_phases.parse(text)) == {}
    assert request_phases.means_ms({}, request_phases.parse("# TYPE other counter\nother_total 3\n")) == {}

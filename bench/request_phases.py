"""The server's request-phase histograms over one run: the mean TTFT the server measured, split into the
scheduler's queue and prefill times, and the rest (the hops between server and scheduler), from two scrapes of
`/metrics` (docs/api.md). A server without these histograms (an older one, another engine) gives no report."""

from __future__ import annotations

import httpx

PHASES = {  # report key -> histogram
    "ttft": "rustinfer_time_to_first_token_seconds",
    "queue": "rustinfer_request_queue_time_seconds",
    "prefill": "rustinfer_request_prefill_time_seconds",
    "decode": "rustinfer_request_decode_time_seconds",
}


def parse(text: str) -> dict[str, float]:
    """`name_sum` / `name_count` of the phase histograms in a /metrics text (summed over label sets)."""
    from prometheus_client.parser import text_string_to_metric_families

    wanted = {f"{name}{suffix}" for name in PHASES.values() for suffix in ("_sum", "_count")}
    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def scrape(url: str) -> dict[str, float]:
    """The phase totals now; {} when the server has no /metrics."""
    try:
        resp = httpx.get(f"{url}/metrics", timeout=10)
    except httpx.HTTPError:
        return {}
    return parse(resp.text) if resp.status_code == 200 else {}


def means_ms(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Each phase's mean over the requests between the two scrapes, in ms, and `hops` = TTFT - queue - prefill;
    {} unless every phase was observed in between."""
    means: dict[str, float] = {}
    for key, name in PHASES.items():
        count = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        if count <= 0:
            return {}
        means[key] = 1e3 * (after[f"{name}_sum"] - before.get(f"{name}_sum", 0.0)) / count
    means["hops"] = means["ttft"] - means["queue"] - means["prefill"]
    return means


def describe(means: dict[str, float]) -> str:
    return (f"server TTFT mean {means['ttft']:.2f} ms = queue {means['queue']:.2f} + prefill {means['prefill']:.2f} "
            f"+ hops {means['hops']:.2f}; decode mean {means['decode']:.1f} ms")

"""bench/attention_prefill.py: its FLOP count against a count of the visible (query, key) pairs, and a dry run on
tiny shapes whose table has a row per (chunk size, config) with every config agreeing with the first."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.bench.scripts import load_bench_script

bench = load_bench_script("attention_prefill")


@pytest.mark.parametrize("q_len,ctx", [(5, 5), (5, 12), (1, 9), (16, 40)])
def test_chunk_flops_counts_the_visible_pairs(q_len, ctx):
    visible = torch.arange(ctx)[None, :] <= torch.arange(ctx - q_len, ctx)[:, None]
    assert bench.chunk_flops(q_len, ctx, 3, 8) == 4 * 8 * 3 * int(visible.sum())


def test_dry_run_table(monkeypatch, capsys):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    argv = ["attention_prefill.py", "--tokens", "40", "--chunks", "40", "16", "--heads", "4", "--kv-heads", "2",
            "--head-dim", "16", "--block-size", "4", "--configs", "default", "32,16,4,1", "--reps", "1",
            "--device", device, "--no-sdpa"]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    rows = [r for r in (line.split() for line in capsys.readouterr().out.splitlines()) if r[1:2] == ["x"]]
    assert [(r[0], r[2], r[3]) for r in rows] == [("1", "40", "default"), ("1", "40", "32,16,4,1"),
                                                  ("3", "16", "default"), ("3", "16", "32,16,4,1")]
    assert all(float(r[-1]) < 2e-2 for r in rows)  # max |diff| from the first config (bf16)


@pytest.mark.parametrize("backend", [None, "math"])
def test_sdpa_yardstick_equals_the_kernel_on_the_last_chunk(backend) -> None:  # noqa: ANN001
    """The sdpa rows' dense K/V, lower-right causal mask and forced backend compute the chunk the paged kernel does."""
    import argparse

    device = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU machine the kernel runs compiled
    args = argparse.Namespace(device=device, block_size=4, tokens=40, kv_heads=2, head_dim=16, heads=4)
    prompt = bench.Prompt(args)
    start, n = 24, 16
    prompt.kernel(start, n, None)()
    got = prompt.sdpa(start, n, backend)()[0].transpose(0, 1)
    torch.testing.assert_close(got.float().cpu(), prompt.out[start : start + n].float().cpu(), atol=2e-2, rtol=2e-2)

"""The decode GEMMs' configs at a row count tuned inside the decode step: each candidate scored by the step's replay.

The kernel benches (`packages/infer-backend-cuda/scripts/bench_quant_gemm.py`, `bench_skinny_gemm.py`,
`bench_mid_gemm.py`) time a kernel alone, with no kernel before it, so they cannot credit what a decode GEMM overlaps
under PDL (the AWQ GEMV's first group asked for before `gdc_wait`, thirty-third session) or what its tail costs inside
the chain (the split-K fix-up's sum, thirty-fourth); the skinny table already holds a 2-row entry faster alone and
slower in the model. Here one linear's candidates (the others at their current choice) are each captured into the
step's graph at `--rows` sequences, and the replay's median over `--steps` replays is the score; coordinate descent
over the model's linears of the scheme, `--rounds` times, the current choice re-timed in every linear's pass. The
lowest of ~15 noisy scores is biased low (thirty-fifth session, H100: the tuner's winners for BF16 and FP8 did not
hold in an interleaved A/B), so a leading candidate is re-scored `--confirm` times interleaved with the incumbent and
taken only where its median is more than `--min-gain-ms` faster (0.02: the A/B's spread on identical tables).
`--write-table` merges the linears whose choice changed into this GPU's tables, each entry with the replay it won
with (`replay_ms`; the kernel benches' entries carry `us`):
- AWQ (`--scheme awq`, one row): `configs/awq_gemm.json`; the one-row GEMV's forms at one and two groups a program,
  the default rule's choice and the tiled kernel's 16-row tile.
- Block FP8 (`--scheme fp8`, one row): the mid GEMM's configs (`configs/mid_gemm.json`, on the quantization pass's
  codes; for the gate / up GEMM with one K range, its gated epilogue) and the FP8 kernels' (`configs/fp8_gemm.json`:
  the tensor-core tiles split over K, the self-quantizing CUDA-core kernel). A winner of the FP8 table turns the
  shape's one-row mid entries off (`use: false`), since the mid table is asked first.
- Dense (`--scheme dense`, 1-8 rows): cuBLAS, the skinny GEMM's forms (`configs/skinny_gemm.json`; for qkv also with
  its RMSNorm in the prologue) and from 2 rows the mid GEMM's (`configs/mid_gemm.json`). The skinny table is asked
  first, and at 1-2 rows its rule answers untuned shapes, so a mid or cuBLAS winner writes `use: false` skinny entries.

    python3 bench/tune_in_model.py --scheme dense --rows 2 --model-dir bench/models/qwen3-4b --out tune.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch
import triton

from ablate_step import named_linears
from decode_roofline import commit, decode_bench, decode_once, prefill_in_groups, random_seqs, replay_times_ms
from infer_backend_cuda.kernels import awq_gemm, fp8_gemm, tuned_table
from infer_backend_cuda.kernels import mid_gemm as mid
from infer_backend_cuda.kernels import skinny_gemm as skinny
from infer_backend_cuda.kernels.awq_gemm import AwqConfig
from infer_backend_cuda.kernels._common import next_pow2
from infer_backend_cuda.kernels.fp8_gemm import Fp8Config
from infer_core.quant import QuantMethod
from infer_worker.application.graph_runner import GraphModelRunner
from infer_worker.application.model_runner import ModelRunner

Shape = tuple[int, int, int]  # (N, K, group; 0 for dense weights)
Config = Any  # a scheme's config NamedTuple
# The one-row AWQ GEMV's program forms: (columns, K step, warps); each with one or two groups a program.
GEMV_FORMS = ((64, 8, 1), (128, 8, 2), (128, 16, 2), (128, 8, 4), (256, 8, 4))
GROUPS_PER_PROGRAM = (1, 2)
# The linear whose GEMM applies SiLU-and-mul (`add_rms_norm_linear_silu_mul`): its FP8 mid configs of one K range run
# the gated epilogue. A bench-side name: the model code does not branch on it.
GATED_LINEAR = "gate_up_proj"
# The FP8 mid GEMM's one-row forms: (columns, warps, stages) at K splits of MID_SPLITS (one range only where gated).
MID_FORMS = ((64, 4, 4), (128, 4, 4), (128, 8, 3))
# The FP8 row-streaming kernel's one-row forms: (rows a program, warps, groups a K step); one warp on 4 groups puts
# every thread along K (sm_90 SASS: 3.3-3.7 instructions a weight with Qwen3-FP8's 128-row scale blocks).
FP8_ROWS_FORMS = ((4, 1, 4), (8, 1, 4), (4, 2, 8))
MID_SPLITS = (1, 2, 4, 8)
# The linear whose dense GEMM may take its (add +) RMSNorm in the skinny kernel's prologue (`add_rms_norm_linear`).
NORMED_LINEAR = "qkv_proj"
# The dense skinny GEMM's forms: (columns, K step, warps, stages) on CUDA cores, and on tensor cores (`use_dot`).
SKINNY_FORMS = ((2, 512, 4, 1), (4, 512, 2, 1), (4, 256, 2, 1), (8, 256, 2, 1), (2, 1024, 4, 1), (4, 1024, 4, 1))
SKINNY_DOT_FORMS = ((64, 256, 4, 3), (32, 128, 4, 3))
# The dense mid GEMM's forms: (columns, warps, stages) at K steps of 128 and one or two K ranges (one where gated).
DENSE_MID_FORMS = ((64, 4, 6), (128, 4, 4))
DENSE_MID_SPLITS = (1, 2)
TRIALS_PER_ROUND = 140  # decode positions a round's trials may take (each trial's capture steps the sequences once)


def linear_shapes(model: object, method: QuantMethod) -> dict[str, Shape]:
    """(N, K, group) of each linear of `method` by attribute name (every layer's linear of a name has one shape)."""
    shapes: dict[str, Shape] = {}
    for attr, linear in named_linears(model):
        scheme, tensors = linear.scheme, linear.params.tensors
        if scheme.method is not method:
            continue
        if method is QuantMethod.AWQ:
            shapes[attr] = (tensors["scales"].shape[1], tensors["qweight"].shape[0], scheme.group_size)
        else:
            n, k = tensors["weight"].shape
            shapes[attr] = (n, k, scheme.block[1])  # 0 for dense weights
    return dict(sorted(shapes.items()))


class SchemeTuner(Protocol):
    method: QuantMethod
    rows: int

    def current(self, attr: str, shape: Shape, device: torch.device) -> Config: ...

    def candidates(self, attr: str, shape: Shape) -> list[Config]: ...

    def override(self, chosen: Mapping[Shape, Config]) -> contextlib.AbstractContextManager[None]: ...

    def write_table(self, chosen: Mapping[str, tuple[Shape, Config]], scores: Mapping[str, float],
                    device_name: str) -> list[str]: ...


def entry_fields(shape: Shape, cfg: Config, replay_ms: float, rows: int = 1) -> dict:
    """A table entry's shape, config and score fields (the FP8 and AWQ tables' layout)."""
    n, k, group = shape
    return {"m": rows, "n": n, "k": k, "group": group, "config": list(cfg), "replay_ms": round(replay_ms, 4)}


@contextlib.contextmanager
def replaced(*swaps: tuple[object, str, object]) -> Iterator[None]:
    """(module, attribute, value) swaps for the block, restored on exit: the dispatch looks them up at each call."""
    before = [(owner, name, getattr(owner, name)) for owner, name, _ in swaps]
    for owner, name, value in swaps:
        setattr(owner, name, value)
    try:
        yield
    finally:
        for owner, name, value in before:
            setattr(owner, name, value)


def op_entry(op: str, rows: int, n: int, k: int, config: Config, replay_ms: float) -> dict:
    """An op-keyed entry of the mid or skinny table (their layout: the config's fields by name), switched on."""
    return {"op": op, "m": rows, "n": n, "k": k, "use": True, **config._asdict(), "replay_ms": round(replay_ms, 4)}


def turned_off(old: dict | None) -> list[dict]:
    """An existing table entry switched off (`use: false`), or nothing where there is none."""
    return [] if old is None else [{**old, "use": False}]


class AwqTuner:
    method, rows = QuantMethod.AWQ, 1

    def current(self, attr: str, shape: Shape, device: torch.device) -> AwqConfig:
        return awq_gemm.choose_config(1, *shape, device)

    def candidates(self, attr: str, shape: Shape) -> list[AwqConfig]:
        """The GEMV forms at one and two groups a program, the default rule's choice, and the tiled kernel's 16-row
        decode tile (the form of the H200's one-row o_proj entry), distinct and valid."""
        n, k, group = shape
        groups = k // group
        found = [awq_gemm.default_config(1, n, k, group)]
        for block_n, block_k, warps in GEMV_FORMS:
            for per in GROUPS_PER_PROGRAM:
                found.append(AwqConfig(1, block_n, awq_gemm.group_block_k(group, block_k), warps, 1,
                                       triton.cdiv(groups, per)))
        tile_k = awq_gemm.group_block_k(group, 128)
        found.append(AwqConfig(16, 64, tile_k, 4, 3, min(k // tile_k, max(1, 512 // triton.cdiv(n, 64)))))
        return list(dict.fromkeys(found))

    def override(self, chosen: Mapping[Shape, AwqConfig]) -> contextlib.AbstractContextManager[None]:
        """`awq_gemm.choose_config` answering `chosen` for one row at those shapes (the tuned table's lookup
        replaced, every other entry kept), restored on exit."""
        original = awq_gemm._tuned_table

        def table(device_name: str) -> dict[tuple[int, int, int, int], AwqConfig]:
            return {**original(device_name), **{(1, *shape): cfg for shape, cfg in chosen.items()}}

        return replaced((awq_gemm, "_tuned_table", table))

    def write_table(self, chosen: Mapping[str, tuple[Shape, AwqConfig]], scores: Mapping[str, float],
                    device_name: str) -> list[str]:
        entries = [entry_fields(shape, cfg, scores[attr]) for attr, (shape, cfg) in chosen.items()]
        tuned_table.merge(awq_gemm._TABLE, device_name, entries, awq_gemm.table_key)
        return [f"merged {len(entries)} one-row entries for {device_name} into {awq_gemm._TABLE}"]


class Fp8Tuner:
    method, rows = QuantMethod.FP8_BLOCK, 1

    def current(self, attr: str, shape: Shape, device: torch.device) -> Config:
        """What the step runs now: the mid table's config (for the gate / up GEMM its gated one), else the FP8
        table's, else the default rule's. A gate / up shape with only a plain mid entry runs that GEMM and then the
        SiLU kernel, which no candidate stands for (a mid candidate there is the gated epilogue): refused."""
        op = "fp8_linear_silu_mul" if attr == GATED_LINEAR else "fp8_linear"
        found = fp8_gemm.mid_config(op, 1, *shape, device)
        if found is not None:
            return found
        if attr == GATED_LINEAR and fp8_gemm.mid_config("fp8_linear", 1, *shape, device) is not None:
            raise ValueError(f"the mid table's one-row fp8_linear entry at gate / up {shape[:2]} runs the GEMM and "
                             "then the SiLU kernel, which the FP8 tuner cannot score: give the shape an "
                             "fp8_linear_silu_mul entry or turn the plain one off")
        return fp8_gemm.choose_config(1, *shape, device) or fp8_gemm.default_config(1, *shape)

    def candidates(self, attr: str, shape: Shape) -> list[Config]:
        """The default rule's tiles, their splits halved, doubled, 2 and 4, the 32- and 128-column tiles, the
        self-quantizing CUDA-core kernel at one and two groups a program, the row-streaming kernel's one-row forms,
        and the mid GEMM's forms (one K range where gated), distinct and valid."""
        n, k, group = shape
        groups = triton.cdiv(k, group)
        base = fp8_gemm.default_config(1, n, k, group)
        found: list[Config] = [base]
        for splits in (max(1, base.k_splits // 2), 2 * base.k_splits, *MID_SPLITS[1:3]):
            found.append(base._replace(k_splits=min(groups, splits)))
        found += [base._replace(block_n=32), base._replace(block_n=128)]
        found += [Fp8Config(1, 64, 4, 3, triton.cdiv(groups, per)) for per in GROUPS_PER_PROGRAM]
        found += [Fp8Config(1, block_n, warps, 1, 1, row_groups) for block_n, warps, row_groups in FP8_ROWS_FORMS]
        splits = (1,) if attr == GATED_LINEAR else tuple(s for s in MID_SPLITS if s <= groups)
        found += [mid.MidConfig(block_n, group, warps, stages, s) for block_n, warps, stages in MID_FORMS
                  for s in splits]
        return list(dict.fromkeys(found))

    def override(self, chosen: Mapping[Shape, Config]) -> contextlib.AbstractContextManager[None]:
        """`fp8_gemm.mid_config` and `choose_config` answering `chosen` for one row at those shapes (a mid config to
        the gated op only with one K range, as the gated epilogue takes), restored on exit."""
        mid_before, table_before = fp8_gemm.mid_config, fp8_gemm.choose_config

        def mid_config(op: str, m: int, n: int, k: int, group: int, device: torch.device) -> mid.MidConfig | None:
            cfg = chosen.get((n, k, group)) if m == 1 else None
            if cfg is None:
                return mid_before(op, m, n, k, group, device)
            gated_ok = op != "fp8_linear_silu_mul" or getattr(cfg, "k_splits", 0) == 1
            return cfg if isinstance(cfg, mid.MidConfig) and gated_ok else None

        def choose_config(m: int, n: int, k: int, group: int, device: torch.device) -> Fp8Config | None:
            cfg = chosen.get((n, k, group)) if m == 1 else None
            if cfg is None:
                return table_before(m, n, k, group, device)
            return cfg if isinstance(cfg, Fp8Config) else None

        return replaced((fp8_gemm, "mid_config", mid_config), (fp8_gemm, "choose_config", choose_config))

    def write_table(self, chosen: Mapping[str, tuple[Shape, Config]], scores: Mapping[str, float],
                    device_name: str) -> list[str]:
        """Mid winners into the mid table (`use: true`); FP8-kernel winners into the FP8 table, with the shape's
        one-row mid entries, which the dispatch asks first, turned off."""
        old_mid = {mid.table_key(e): e for e in tuned_table.entries(mid._TABLE, device_name)}
        mid_new, fp8_new = [], []
        for attr, (shape, cfg) in chosen.items():
            n, k, _ = shape
            gated = attr == GATED_LINEAR and isinstance(cfg, mid.MidConfig) and cfg.k_splits == 1
            served = "fp8_linear_silu_mul" if gated else "fp8_linear"
            if isinstance(cfg, mid.MidConfig):
                mid_new.append(op_entry(served, 1, n, k, cfg, scores[attr]))
            else:
                fp8_new.append(entry_fields(shape, cfg, scores[attr]))
            for op in ("fp8_linear_silu_mul", "fp8_linear"):
                if not (isinstance(cfg, mid.MidConfig) and op == served):
                    mid_new += turned_off(old_mid.get((op, 1, n, k)))
        tuned_table.merge(mid._TABLE, device_name, mid_new, mid.table_key)
        tuned_table.merge(fp8_gemm._TABLE, device_name, fp8_new, fp8_gemm.table_key)
        return [f"merged {len(mid_new)} mid and {len(fp8_new)} FP8 one-row entries for {device_name}"]


class DenseChoice(NamedTuple):
    """A dense GEMM's path at the tuned rows: cuBLAS, the skinny GEMM (`norm_skinny`: with the RMSNorm in its
    prologue) or the mid GEMM, with that kernel's config."""

    path: str  # "cublas" | "skinny" | "norm_skinny" | "mid"
    config: skinny.SkinnyConfig | mid.MidConfig | None = None


class DenseTuner:
    method = QuantMethod.DENSE

    def __init__(self, rows: int = 1) -> None:
        if not 1 <= rows <= skinny.MAX_M:
            raise ValueError(f"the dense tuner takes 1..{skinny.MAX_M} rows, got {rows}")
        self.rows = rows

    def current(self, attr: str, shape: Shape, device: torch.device) -> DenseChoice:
        """The path `CudaMathOps.triton_gemm_config` takes now (the fused norm first where the linear has one)."""
        n, k, _ = shape
        if attr == NORMED_LINEAR:
            found = skinny.choose_config("add_rms_norm_linear", self.rows, n, k, device)
            if found is not None:
                return DenseChoice("norm_skinny", found)
        found = skinny.choose_config("linear", self.rows, n, k, device)
        if found is not None:
            return DenseChoice("skinny", found)
        op = "linear_silu_mul" if attr == GATED_LINEAR else "linear"
        found = mid.choose_config(op, self.rows, n, k, device)
        return DenseChoice("mid", found) if found is not None else DenseChoice("cublas")

    def candidates(self, attr: str, shape: Shape) -> list[DenseChoice]:
        """cuBLAS; the skinny rule's config and forms, on CUDA and tensor cores (for qkv also with the norm in the
        prologue), at 1-2 rows the CUDA-core forms that fit also with the row-wise accumulators; from 2 rows the mid
        GEMM's forms (one K range where gated), distinct."""
        n, k, _ = shape
        found = [DenseChoice("cublas"), DenseChoice("skinny", skinny.heuristic_config(self.rows, n, k))]
        cuda_cores = [skinny.SkinnyConfig(bn, min(bk, next_pow2(k)), w, st) for bn, bk, w, st in SKINNY_FORMS]
        rowwise = [c._replace(rowwise=True) for c in cuda_cores if self.rows <= 2 and skinny.rowwise_fits(c, 2)]
        found += [DenseChoice("skinny", cfg) for cfg in cuda_cores + rowwise]
        found += [DenseChoice("skinny", skinny.SkinnyConfig(bn, bk, w, st, use_dot=True))
                  for bn, bk, w, st in SKINNY_DOT_FORMS]
        if attr == NORMED_LINEAR:
            found += [DenseChoice("norm_skinny", cfg) for cfg in cuda_cores[:3] + rowwise[:2]]
        if self.rows >= mid.MIN_M:
            splits = (1,) if attr == GATED_LINEAR else DENSE_MID_SPLITS
            found += [DenseChoice("mid", mid.MidConfig(bn, 128, w, st, s)) for bn, w, st in DENSE_MID_FORMS
                      for s in splits]
        return list(dict.fromkeys(found))

    def override(self, chosen: Mapping[Shape, DenseChoice]) -> contextlib.AbstractContextManager[None]:
        """`skinny.choose_config` and `mid.choose_config` (dense ops) answering `chosen` at the tuned rows and
        shapes, restored on exit."""
        skinny_before, mid_before = skinny.choose_config, mid.choose_config

        def skinny_config(op: str, m: int, n: int, k: int, device: torch.device) -> skinny.SkinnyConfig | None:
            choice = chosen.get((n, k, 0)) if m == self.rows else None
            if choice is None:
                return skinny_before(op, m, n, k, device)
            return choice.config if choice.path == ("norm_skinny" if op == "add_rms_norm_linear" else "skinny") \
                else None

        def mid_config(op: str, m: int, n: int, k: int, device: torch.device) -> mid.MidConfig | None:
            choice = chosen.get((n, k, 0)) if m == self.rows and op in mid.OPS else None
            if choice is None:
                return mid_before(op, m, n, k, device)
            return choice.config if choice.path == "mid" else None

        return replaced((skinny, "choose_config", skinny_config), (mid, "choose_config", mid_config))

    def write_table(self, chosen: Mapping[str, tuple[Shape, DenseChoice]], scores: Mapping[str, float],
                    device_name: str) -> list[str]:
        """The winner's entry `use: true`; the entries asked before it (the skinny table's, which at 1-2 rows its
        rule answers where the table is silent) and the mid entry of a skinny or cuBLAS winner `use: false`."""
        old_skinny = {skinny.table_key(e): e for e in tuned_table.entries(skinny._TABLE, device_name)}
        old_mid = {mid.table_key(e): e for e in tuned_table.entries(mid._TABLE, device_name)}
        rule_answers = skinny.m_bucket(self.rows) <= 2
        skinny_new, mid_new = [], []
        for attr, ((n, k, _), choice) in chosen.items():
            base = {"m": self.rows, "n": n, "k": k, "replay_ms": round(scores[attr], 4)}
            ops = (("add_rms_norm_linear", "norm_skinny"),) if attr == NORMED_LINEAR else ()
            for op, path in (*ops, ("linear", "skinny")):
                old = old_skinny.get((op, self.rows, n, k))
                if choice.path == path:
                    skinny_new.append(op_entry(op, self.rows, n, k, choice.config, scores[attr]))
                elif old is not None or rule_answers:
                    rule = skinny.heuristic_config(self.rows, n, k)._asdict()
                    skinny_new.append({"op": op, **base, **(old or rule), "use": False})
            mid_op = "linear_silu_mul" if attr == GATED_LINEAR else "linear"
            if choice.path == "mid":
                mid_new.append(op_entry(mid_op, self.rows, n, k, choice.config, scores[attr]))
            else:
                mid_new += turned_off(old_mid.get((mid_op, self.rows, n, k)))
        tuned_table.merge(skinny._TABLE, device_name, skinny_new, skinny.table_key)
        tuned_table.merge(mid._TABLE, device_name, mid_new, mid.table_key)
        return [f"merged {len(skinny_new)} skinny and {len(mid_new)} mid entries of {self.rows} rows for {device_name}"]


def descend(shapes: Mapping[str, Shape], tries: Mapping[str, list[Config]], chosen: dict[str, Config],
            score: Callable[[Mapping[str, Config]], float], rounds: int, confirm: int, min_gain_ms: float,
            log: list[dict]) -> tuple[dict[str, float], list[str]]:
    """Coordinate descent over the linears: each linear's incumbent and candidates scored once (the others at their
    current choice). The minimum of ~15 noisy scores is biased low, so a leading candidate is re-scored `confirm`
    times interleaved with the incumbent and replaces it only where the medians differ by more than `min_gain_ms`.
    Updates `chosen`; returns each linear's score (the median of the re-scores where there were any) and the linears
    whose choice changed."""
    scores: dict[str, float] = {}
    changed: list[str] = []
    for round_ in range(rounds):
        for attr, shape in shapes.items():
            incumbent = chosen[attr]
            timed = []
            for cfg in [incumbent, *tries[attr]]:
                ms = score({**chosen, attr: cfg})
                timed.append((ms, cfg))
                log.append({"round": round_, "linear": attr, "shape": shape, "kind": type(cfg).__name__,
                            "config": list(cfg), "replay_ms": ms})
                print(f"round {round_} {attr:<14} {type(cfg).__name__:<10} {str(list(cfg)):<42} {ms:.4f} ms",
                      flush=True)
            lead_ms, lead = min(timed, key=lambda t: t[0])
            kept_ms = timed[0][0]
            if lead != incumbent and confirm:
                pairs = [(score({**chosen, attr: incumbent}), score({**chosen, attr: lead})) for _ in range(confirm)]
                kept_ms, lead_ms = (statistics.median(side) for side in zip(*pairs))
                log.append({"round": round_, "linear": attr, "confirm": [list(p) for p in pairs]})
                print(f"round {round_} {attr:<14} re-scored: incumbent {kept_ms:.4f}, lead {lead_ms:.4f} ms",
                      flush=True)
            if lead != incumbent and kept_ms - lead_ms > min_gain_ms:
                chosen[attr], scores[attr] = lead, lead_ms
                if attr not in changed:
                    changed.append(attr)
            else:
                scores[attr] = kept_ms
            print(f"round {round_} {attr:<14} keeps {type(chosen[attr]).__name__} {list(chosen[attr])} "
                  f"{scores[attr]:.4f} ms", flush=True)
    return scores, changed


def tuner(scheme: str, rows: int) -> SchemeTuner:
    """The scheme's tuner at `rows` (AWQ and FP8: one row, where their one-row kernels and tables differ)."""
    if scheme == "dense":
        return DenseTuner(rows)
    if rows != 1:
        raise SystemExit(f"--scheme {scheme} tunes one row only")
    return AwqTuner() if scheme == "awq" else Fp8Tuner()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--scheme", choices=("awq", "dense", "fp8"), default="awq")
    ap.add_argument("--rows", type=int, default=1, help="decode rows (sequences) of the tuned step")
    ap.add_argument("--model-dir", type=Path, default=Path("bench/models/qwen3-4b-awq"))
    ap.add_argument("--context", type=int, default=280)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--confirm", type=int, default=3,
                    help="interleaved re-scores of a linear's best candidate and its incumbent before it is taken")
    ap.add_argument("--min-gain-ms", type=float, default=0.02,
                    help="how much faster (median of the re-scores) a candidate must be to replace the incumbent")
    ap.add_argument("--write-table", action="store_true")
    ap.add_argument("--out", type=Path, default=Path("tune_in_model.json"))
    args = ap.parse_args()
    chooser = tuner(args.scheme, args.rows)

    # each sequence's pages for the prompt and a decode step a trial (~16 a linear a round, and 2 x --confirm where a
    # candidate leads); a trial past them stops
    room = TRIALS_PER_ROUND + 10 * args.confirm
    bench = decode_bench(args.model_dir, args.rows, args.context + room * args.rounds + 16, args.block_size)
    shapes = linear_shapes(bench.model, chooser.method)
    if not shapes:
        raise SystemExit(f"{args.model_dir} has no {chooser.method.value} linears")
    tries = {attr: chooser.candidates(attr, shape) for attr, shape in shapes.items()}
    trials = sum(len(c) + 1 + 2 * args.confirm for c in tries.values())
    if args.context + args.rounds * trials > bench.blocks_per_seq * bench.block_size:
        raise SystemExit(f"{trials} trials a round, more than the sequences' pages hold: raise TRIALS_PER_ROUND")
    seqs = random_seqs(bench, args.rows, args.context, torch.Generator().manual_seed(0))
    prefill_in_groups(ModelRunner(*bench.runner_args, state_pools=bench.caches.state_pools), seqs)
    device = torch.device("cuda")
    try:
        chosen = {attr: chooser.current(attr, shape, device) for attr, shape in shapes.items()}
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    kept: list[GraphModelRunner] = []  # graphs share the backend's pool: freeing one breaks the next capture

    def replay_ms(trial: Mapping[str, Config]) -> float:
        with chooser.override({shapes[attr]: cfg for attr, cfg in trial.items()}):
            graph = GraphModelRunner(*bench.runner_args, state_pools=bench.caches.state_pools,
                                     capture_sizes=[args.rows])
            graph.capture()
            decode_once(graph, seqs)  # the replay's inputs, as a step leaves them
            kept.append(graph)
            return statistics.median(replay_times_ms(graph._graphs[(args.rows, True)], args.steps))

    log: list[dict] = []
    scores, changed = descend(shapes, tries, chosen, replay_ms, args.rounds, args.confirm, args.min_gain_ms, log)
    name = torch.cuda.get_device_name(0)
    winners = [{"linear": attr, "kind": type(cfg).__name__,
                **entry_fields(shapes[attr], cfg, scores[attr], args.rows)} for attr, cfg in chosen.items()]
    args.out.write_text(json.dumps({"gpu": name, "scheme": args.scheme, "rows": args.rows, "model": str(args.model_dir),
                                    "context": args.context, "commit": commit(), "chosen": winners, "trials": log},
                                   indent=2))
    if args.write_table and changed:
        for line in chooser.write_table({attr: (shapes[attr], chosen[attr]) for attr in changed}, scores, name):
            print(line)
    elif args.write_table:
        print("no linear's choice changed: the tables are left as they are")


if __name__ == "__main__":
    main()

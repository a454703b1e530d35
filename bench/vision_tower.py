"""The vision tower's GPU time for one image, on the CUDA backend with dummy weights (BF16): what an image adds to
its request's time to first token, apart from the text prefill.

The default shape is Qwen3-VL-4B's vision encoder (depth 24, hidden 1024, 16 heads, MLP 4096, output 2560, 16-pixel
patches, 2x2 merge), which Qwen3.5-4B's vision_config is taken to match; override with the flags.

    python bench/vision_tower.py --sizes 448,1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from infer_worker.components.vision import VisionConfig, VisionTower
from infer_worker.infrastructure.backend_registry import create_backend


def time_ms(fn, repeats: int, cuda: bool) -> float:  # noqa: ANN001 - a thunk
    """Median milliseconds of `fn`: GPU time by CUDA events, else wall time (the CPU backend, for a dry run)."""
    times = []
    for _ in range(repeats):
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b))
        else:
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="448,1024", help="square image sides in pixels (multiples of 32)")
    ap.add_argument("--depth", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--out-hidden", type=int, default=2560)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--backend", default="cuda", help="cuda; cpu for a dry run of a small shape")
    args = ap.parse_args()
    config = VisionConfig(depth=args.depth, hidden_size=args.hidden, intermediate_size=args.intermediate,
                          num_heads=args.heads, in_channels=3, patch_size=16, temporal_patch_size=2,
                          spatial_merge_size=2, out_hidden_size=args.out_hidden, num_position_embeddings=2304)
    backend = create_backend(args.backend, "")
    cuda = args.backend == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    tower = VisionTower(backend.ops, config, dtype, backend.device)
    generator = torch.Generator(device=backend.device).manual_seed(0)
    for name, slot in sorted(tower.weight_slots().items()):
        slot.init_dummy(generator)
    rows = []
    for side in (int(s) for s in args.sizes.split(",")):
        grid = (1, side // 16, side // 16)
        pixels = torch.randn(grid[1] * grid[2], config.patch_dim, device=backend.device, dtype=dtype)
        for _ in range(3):
            tower(pixels, [grid])
        ms = time_ms(lambda: tower(pixels, [grid]), args.repeats, cuda)  # noqa: B023 - timed at once
        rows.append({"image": f"{side}x{side}", "patches": grid[1] * grid[2], "tokens": tower.num_tokens(grid),
                     "tower_ms": round(ms, 2)})
        print(json.dumps(rows[-1]))
    device = torch.cuda.get_device_name(0) if cuda else "cpu"
    print(json.dumps({"device": device, "dtype": str(dtype), "config": repr(config), "results": rows}))


if __name__ == "__main__":
    main()

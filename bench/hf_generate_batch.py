"""The offline peer: HF transformers' continuous batching (`generate_batch`) on the same workload as
bench/offline_throughput.py, on a model built from a config.json with random BF16 weights (no checkpoint).

    python bench/hf_generate_batch.py --model-dir .bench-models/qwen3-4b-dummy --num-seqs 256 \
        --input-len 512 --output-len 256 --out hf_generate_batch.json

Output tokens are counted from what generate_batch returns (a random model rarely emits EOS).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000, help="prompt ids are drawn below this")
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=Path("hf_generate_batch.json"))
    args = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(args.model_dir)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation=args.attn)
    model = model.to("cuda").eval()
    rng = random.Random(args.seed)
    inputs = [[rng.randrange(100, args.vocab) for _ in range(args.input_len)] for _ in range(args.num_seqs)]
    gen = GenerationConfig(max_new_tokens=args.output_len, do_sample=False, eos_token_id=None, pad_token_id=0)
    start = time.perf_counter()
    outputs = model.generate_batch(inputs=inputs, generation_config=gen, progress_bar=False)
    wall = time.perf_counter() - start
    out_tokens = sum(len(o.generated_tokens) for o in outputs.values())
    result = {"peer": f"transformers {transformers.__version__} generate_batch ({args.attn})",
              "torch": torch.__version__, "num_seqs": args.num_seqs, "input_len": args.input_len,
              "output_len": args.output_len, "wall_s": wall, "output_tokens": out_tokens,
              "output_tok_per_s": out_tokens / wall,
              "total_tok_per_s": (out_tokens + args.num_seqs * args.input_len) / wall}
    print(json.dumps(result, indent=2))
    args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

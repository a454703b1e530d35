"""Diagnostic: after each masked sampling replay, the same inputs sampled eagerly; mismatching rows printed."""
import tempfile
from pathlib import Path

import torch

from infer_worker.application import graph_runner as gr
from infer_worker.application.structured_output import refused_tokens
from tests.worker.test_structured_output import check_structured_through_the_engine
from tests.worker.tiny_checkpoints import llama_config, write_checkpoint

orig = gr.GraphModelRunner._sample_replayed


def wrapped(self, seqs, greedy):
    before = self.masked_sample_steps
    launched = orig(self, seqs, greedy)
    if self.masked_sample_steps != before:
        n = len(seqs)
        size = self.capture_sizes[gr.bisect.bisect_left(self.capture_sizes, n)]
        buf, m = self._buf, self._masks
        logits = buf.logits[:size].clone()
        idx = m.index[:size].clone()
        words = m.bits.index_select(0, idx)
        masked = logits.masked_fill(refused_tokens(words, m.bit_values, logits.shape[-1]), float("-inf"))
        out = self._sampler.sample(masked, buf.sampling_batch(size, greedy))
        torch.cuda.synchronize()
        bad = (out.token_ids[:n] != buf.out_tokens[:n]).nonzero().flatten().tolist()
        print(f"step n={n} size={size} greedy={greedy} idx={idx[:n].tolist()} mismatch rows={bad} "
              f"graph={buf.out_tokens[:n].tolist()} eager={out.token_ids[:n].tolist()}" if bad else
              f"ok n={n} size={size} greedy={greedy} idx={idx[:n].tolist()}")
    return launched


gr.GraphModelRunner._sample_replayed = wrapped
from infer_backend_cuda import CudaBackend  # noqa: E402

d = Path(tempfile.mkdtemp())
write_checkpoint(llama_config(), d, seed=5)
try:
    check_structured_through_the_engine(d, True, lambda: CudaBackend("cuda:0"), compare_free=False)
    print("check passed")
except AssertionError as exc:
    print("check failed:", str(exc)[:300])

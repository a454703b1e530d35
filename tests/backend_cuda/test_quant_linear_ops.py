"""The CUDA adapter's per-scheme `LinearOps` (the Triton GEMMs behind the norm / SiLU kernels), bound by a tiny
quantized model exactly as at serving time, against the CPU backend's on the same checkpoint (interpreter-sized)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from infer_backend_cpu import CpuBackend
from infer_backend_cuda import linear_ops
from infer_backend_cuda.linear_ops import CudaLinears
from infer_backend_cuda.ops import CudaMathOps, TritonFusedOps
from infer_core.ports.op_ports import OpPorts
from infer_worker.infrastructure.model_loader import read_config
from infer_worker.infrastructure.weight_loader import iter_safetensors
from infer_worker.models.llama import LlamaForCausalLM
from infer_worker.models.spec import ModelSpec
from tests.worker.quant_checkpoints import awq_config, fp8_config, write_quantized
from tests.worker.tiny_checkpoints import llama_config, random_hf_model


def _cuda_ops_on_this_device() -> OpPorts:
    cpu = CpuBackend().ops
    math = CudaMathOps(skinny_gemm=False)
    fused = TritonFusedOps(math)
    return OpPorts(math=math, fused=fused, sampler=cpu.sampler, collective=cpu.collective,
                   linears=CudaLinears(math, fused), gdn=cpu.gdn)


@pytest.mark.parametrize("quant,norm_quant", [(awq_config(32), False), (fp8_config((32, 32)), False),
                                              (fp8_config((32, 32)), True)], ids=["awq", "fp8", "fp8-norm-quant"])
def test_quantized_layers_match_the_cpu_reference(quant: dict, norm_quant: bool, tmp_path: Path, device: str,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8-norm-quant: the norms before qkv and gate / up done by the GEMMs' quantization pass
    (INFER_CUDA_FP8_NORM_QUANT=1)."""
    monkeypatch.setattr(linear_ops, "FP8_NORM_QUANT", norm_quant)
    config = llama_config(num_hidden_layers=1)
    write_quantized(random_hf_model(config, seed=4).state_dict(), config.to_dict(), tmp_path, quant, torch.float32)
    spec = ModelSpec.from_hf_config(read_config(tmp_path))
    models = {}
    for name, ops in (("cpu", CpuBackend().ops), ("cuda", _cuda_ops_on_this_device())):
        model = LlamaForCausalLM(spec, ops, torch.float32, device if name == "cuda" else "cpu")
        model.load_weights(iter_safetensors(tmp_path))
        models[name] = model
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    down_in = torch.randn(5, 96, generator=torch.Generator().manual_seed(1))
    outputs = {}
    for name in ("cpu", "cuda"):
        layer = models[name].layers[0]
        xs = x.to(device if name == "cuda" else "cpu")
        qkv, stream = layer.input_norm.project(xs, xs * 0.5, layer.mixer.qkv_proj)
        down = layer.mlp.down_proj(down_in.to(xs.device))
        act, _ = layer.post_attention_norm.project_silu_mul(xs, xs * 0.25, layer.mlp.gate_up_proj)
        outputs[name] = (qkv.cpu(), stream.cpu(), down.cpu(), layer.mixer.o_proj(xs).cpu(), act.cpu())
    for got, expected in zip(outputs["cuda"], outputs["cpu"]):
        torch.testing.assert_close(got, expected, atol=2e-4, rtol=2e-4)

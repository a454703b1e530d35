"""How a linear layer's weight is stored: dense, AWQ int4 (W4A16) or block FP8 (W8A8).

The scheme is data carried by the weight: the model builds each linear with its scheme and the backend binds that
scheme's kernels once (`LinearOpsFactory.bind`), so no model or component code branches on it. Pure Python: the
shape arithmetic and the start-up checks of each layout live here, the tensors in the worker and the backends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

AWQ_PACK = 8  # 4-bit values per int32
FP8_E4M3_MAX = 448.0  # the largest finite float8_e4m3fn: dynamic activation scales are amax / FP8_E4M3_MAX


class QuantMethod(str, Enum):
    DENSE = "dense"
    # AutoAWQ "gemm": qweight int32 [in, out/8], qzeros int32 [in/group, out/8], scales fp16 [in/group, out]
    AWQ = "awq"
    FP8_BLOCK = "fp8-block"  # weight e4m3 [out, in], weight_scale_inv [ceil(out/bo), ceil(in/bi)]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class QuantScheme:
    method: QuantMethod = QuantMethod.DENSE
    group_size: int = 0  # AWQ: input rows that share one scale and zero point
    block: tuple[int, int] = (0, 0)  # FP8: (out, in) extent of one weight scale; `in` is also the activation group

    @classmethod
    def awq(cls, group_size: int) -> "QuantScheme":
        return cls(QuantMethod.AWQ, group_size=group_size)

    @classmethod
    def fp8_block(cls, block_out: int, block_in: int) -> "QuantScheme":
        return cls(QuantMethod.FP8_BLOCK, block=(block_out, block_in))

    @property
    def checkpoint_names(self) -> tuple[str, ...]:
        """The tensors of one linear in a checkpoint (suffixes after the module name), in operand order."""
        return _CHECKPOINT_NAMES[self.method]

    def shapes(self, out_features: int, in_features: int) -> dict[str, tuple[int, ...]]:
        """Each checkpoint tensor's shape for a linear of this size."""
        if self.method is QuantMethod.AWQ:
            groups, packed = in_features // self.group_size, out_features // AWQ_PACK
            return {"qweight": (in_features, packed), "qzeros": (groups, packed), "scales": (groups, out_features)}
        if self.method is QuantMethod.FP8_BLOCK:
            bo, bi = self.block
            return {"weight": (out_features, in_features),
                    "weight_scale_inv": (_cdiv(out_features, bo), _cdiv(in_features, bi))}
        return {"weight": (out_features, in_features)}

    def check(self, module: str, out_features: int, in_features: int) -> None:
        """Refuse, naming the module, a linear whose size this layout cannot hold. FP8's partial edge blocks are
        fine (the scale grid rounds up); AWQ needs whole groups and whole int32 words."""
        if self.method is QuantMethod.AWQ:
            if in_features % self.group_size:
                raise ValueError(f"{module}: quantization_config.group_size {self.group_size} does not divide its "
                                 f"in_features {in_features}")
            if out_features % AWQ_PACK:
                raise ValueError(f"{module}: out_features {out_features} is not a multiple of {AWQ_PACK} "
                                 f"(AWQ packs eight 4-bit columns per int32)")

    def check_split(self, module: str, features: int, dim: int, world: int) -> None:
        """Tensor parallelism cuts dimension `dim` of `[out, in]` (`features` long) into `world` equal slices;
        block FP8's scale grid must be cut with it, so each slice must be whole blocks."""
        if self.method is QuantMethod.FP8_BLOCK and world > 1 and (features // world) % self.block[dim]:
            side = ("out", "in")[dim]
            raise ValueError(f"{module}: {side}_features {features} / tensor_parallel_size {world} is not a multiple "
                             f"of the FP8 block {self.block[dim]} (quantization_config.weight_block_size)")


DENSE = QuantScheme()

_CHECKPOINT_NAMES: dict[QuantMethod, tuple[str, ...]] = {
    QuantMethod.DENSE: ("weight",),
    QuantMethod.AWQ: ("qweight", "qzeros", "scales"),
    QuantMethod.FP8_BLOCK: ("weight", "weight_scale_inv"),
}


@dataclass(frozen=True, slots=True)
class QuantConfig:
    """A checkpoint's `quantization_config`: the scheme of its converted linears and the modules left dense.

    `modules_to_not_convert` matches as AutoAWQ and transformers do: a module stays dense when any entry is a
    substring of its name. Embeddings, norms and `lm_head` are never converted, whatever the config says."""

    scheme: QuantScheme = DENSE
    modules_to_not_convert: tuple[str, ...] = field(default_factory=tuple)

    def scheme_for(self, module: str) -> QuantScheme:
        if module == "lm_head" or any(entry in module for entry in self.modules_to_not_convert):
            return DENSE
        return self.scheme


DENSE_CONFIG = QuantConfig()


@dataclass(frozen=True, slots=True)
class ModuleQuant:
    """`QuantConfig` seen from inside a module (`model.layers.3.self_attn.`): components name their linears
    relative to themselves, as in their weight slots."""

    config: QuantConfig
    prefix: str = ""

    def name(self, relative: str) -> str:
        """The module's full name; `name("")` is this module's own (without the trailing dot)."""
        return f"{self.prefix}{relative}" if relative else self.prefix.rstrip(".")

    def scheme(self, relative: str) -> QuantScheme:
        return self.config.scheme_for(self.name(relative))

    def fused_scheme(self, parts: tuple[str, ...]) -> QuantScheme:
        """The one scheme of projections fused into one GEMM; refuses parts that `modules_to_not_convert` splits."""
        schemes = {self.scheme(part) for part in parts}
        if len(schemes) > 1:
            names = ", ".join(self.name(part) for part in parts)
            raise ValueError(f"quantization_config.modules_to_not_convert leaves only some of {names} dense; "
                             f"they are fused into one GEMM and need one layout")
        return schemes.pop()

    def within(self, relative_prefix: str) -> "ModuleQuant":
        return ModuleQuant(self.config, self.prefix + relative_prefix)

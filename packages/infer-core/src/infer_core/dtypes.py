"""Backend-neutral dtypes: core names them, each backend maps them to its own tensor dtypes."""

from __future__ import annotations

from enum import Enum


class DType(str, Enum):
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    INT32 = "int32"
    INT64 = "int64"

    @property
    def itemsize(self) -> int:
        return _ITEMSIZE[self]

    @property
    def is_float(self) -> bool:
        return self in (DType.FLOAT32, DType.BFLOAT16, DType.FLOAT16)

    @classmethod
    def parse(cls, name: str) -> "DType":
        """Accept HF-style names (`torch_dtype = "bfloat16"`, `"float"`, `"half"`)."""
        aliases = {"float": cls.FLOAT32, "fp32": cls.FLOAT32, "half": cls.FLOAT16, "fp16": cls.FLOAT16, "bf16": cls.BFLOAT16}
        key = name.lower().removeprefix("torch.")
        if key in aliases:
            return aliases[key]
        try:
            return cls(key)
        except ValueError:
            raise ValueError(f"unknown dtype {name!r}; expected one of {[d.value for d in cls]}") from None


_ITEMSIZE = {
    DType.FLOAT32: 4,
    DType.BFLOAT16: 2,
    DType.FLOAT16: 2,
    DType.INT32: 4,
    DType.INT64: 8,
}

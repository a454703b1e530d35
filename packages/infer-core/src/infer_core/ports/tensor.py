"""The tensor alias. Backends pass framework tensors (torch.Tensor); core only names them."""

from typing import Any, TypeAlias

Tensor: TypeAlias = Any

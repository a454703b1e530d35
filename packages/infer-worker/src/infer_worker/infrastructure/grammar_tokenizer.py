"""The model's tokenizer as xgrammar sees it (the vocabulary its token bitmasks are over).

Loaded on the first structured-output request only (transformers and the vocabulary scan cost seconds), from the
model directory's tokenizer files, which every servable model directory has (the server reads the same ones).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable


def tokenizer_info_factory(model_dir: Path) -> Callable[[int], Any]:
    def load(vocab_size: int) -> Any:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        # vocab_size: the model's logits width (it may pad past the tokenizer's ids: those are never allowed).
        return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)

    return load

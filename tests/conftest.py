"""Shared fixtures: tiny random source models of each supported architecture, and the real SmolLM2 (cached once)."""

from __future__ import annotations

import os
import string
from pathlib import Path

import pytest
import torch

# Triton kernels run interpreted on CPU: CI covers them this way, at small sizes. Set before anything imports
# triton.language (transformers 5.17 does on import), which decides then whether @triton.jit interprets.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest -n (xdist) every worker takes one core: torch's own threads on top of the workers oversubscribe the
# cores, and its thread pools then wait on each other (a test of 2 s took 30). OMP_NUM_THREADS: the processes tests
# start (torchrun, a clean interpreter) inherit it.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

from tokenizers import Tokenizer, decoders, models  # noqa: E402
from transformers import CONFIG_MAPPING, AutoModelForCausalLM, PreTrainedTokenizerFast  # noqa: E402

SMOLLM2_ENV = "RAVEN_SMOLLM2_GGUF"

# A few layers, two KV heads shared by two query heads each, odd head counts avoided to keep shapes small.
TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
TINY_OVERRIDES = {
    "llama": {},
    "qwen3": {"num_hidden_layers": 24},  # so that --layers 0-23:5 means what it means for Qwen3-0.6B
    "mistral": {"sliding_window": 8},  # every layer windowed: masks and caches must honour it
    "qwen2": {"tie_word_embeddings": True},
}


def tiny_config(model_type: str, **overrides):
    return CONFIG_MAPPING[model_type](**{**TINY, **TINY_OVERRIDES[model_type], **overrides})


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer: no Hub needed."""
    vocab = {c: i for i, c in enumerate(["<pad>", "<s>", "</s>", "<unk>", *sorted(set(string.printable))])}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>"
    )


def make_tiny_source(model_type: str, path: Path, seed: int = 0, **overrides) -> Path:
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides)).eval()
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_sources(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny_sources")
    return {name: make_tiny_source(name, root / name) for name in TINY_OVERRIDES}


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct dequantised once per run into a Hugging Face directory (float32)."""
    gguf = os.environ.get(SMOLLM2_ENV)
    if not gguf or not Path(gguf).is_file():
        pytest.skip(f"real SmolLM2 not available: set {SMOLLM2_ENV} to the GGUF file (.ci/run does)")
    from raven_convert import Source

    source = Source.resolve(gguf)
    out = tmp_path_factory.mktemp("smollm2")
    model = source.load_model("float32")
    model.save_pretrained(out)
    source.load_tokenizer().save_pretrained(out)
    return out


@pytest.fixture
def mixer_registry(monkeypatch):
    """raven_layers.registry, whose registrations during the test are undone after it."""
    from raven_layers import registry

    monkeypatch.setattr(registry, "_mixers", dict(registry._mixers))
    return registry


def pytest_report_header(config):
    import transformers

    return f"torch {torch.__version__}, transformers {transformers.__version__}"

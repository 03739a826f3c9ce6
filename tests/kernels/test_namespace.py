"""Our `kernels` package is not Hugging Face's `kernels`, and transformers does not mistake one for the other."""

import json
import subprocess
import sys
import textwrap
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import tomllib
from packaging.version import Version
from transformers.utils.import_utils import KERNELS_MAX_VERSION, KERNELS_MIN_VERSION

REPO = Path(__file__).resolve().parents[2]


def test_our_version_is_outside_the_range_transformers_accepts():
    # transformers maps the import name `kernels` to the distribution that ships it: ours, once installed.
    declared = Version(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"])
    assert not Version(KERNELS_MIN_VERSION) <= declared < Version(KERNELS_MAX_VERSION)
    try:
        assert Version(version("raven-hybrid")) == declared
    except PackageNotFoundError:  # run from a checkout without installing: nothing for transformers to confuse
        pass


def test_transformers_does_not_take_our_kernels_for_hub_kernels():
    # A fresh interpreter: transformers caches these probes for the life of a process.
    code = textwrap.dedent(
        """
        import json, kernels
        from transformers.utils.import_utils import is_kernels_available
        import transformers.integrations.hub_kernels as hub_kernels
        from transformers import AutoModelForCausalLM, LlamaConfig
        model = AutoModelForCausalLM.from_config(LlamaConfig(hidden_size=16, intermediate_size=32,
            num_hidden_layers=1, num_attention_heads=2, vocab_size=32))
        print(json.dumps({"file": kernels.__file__, "available": is_kernels_available(),
                          "loaded": type(model).__name__}))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(result["file"]).resolve() == REPO / "kernels" / "__init__.py"
    assert result["available"] is False
    assert result["loaded"] == "LlamaForCausalLM"

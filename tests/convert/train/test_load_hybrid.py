"""Loading a hybrid does not depend on import order: the stages always train the toolkit's own classes, and
importing any module of raven_layers registers them with transformers' Auto classes (checked in fresh processes)."""

import os
import textwrap
from pathlib import Path

import pytest

import raven_convert
from raven_convert.cli import main as convert_main
from tests.helpers import run_python

ROOT = Path(raven_convert.__file__).resolve().parents[1]  # this checkout, whatever is installed
ORDERS = {
    # transformers loads the directory before anything of the toolkit is imported: it runs the code the directory
    # carries; the stages imported after it still load the toolkit's own classes
    "the directory's own code first": """
        from transformers import AutoModelForCausalLM
        first = AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)
        from raven_convert.train.models import load_hybrid
        hybrid = load_hybrid(OUT)
    """,
    # one module of the model package, then a plain Auto load (no trust_remote_code): the package's import registered
    # the hybrid, so the load finds the toolkit's classes
    "a module of raven_layers first": """
        from raven_layers.masks import find_packed_documents
        from transformers import AutoModelForCausalLM
        first = AutoModelForCausalLM.from_pretrained(OUT)
        from raven_convert.train.models import load_hybrid
        hybrid = load_hybrid(OUT)
    """,
    # the source loader (raven-eval, the teacher) on its own
    "the source loader first": """
        from raven_convert.sources import Source
        first = Source.resolve(OUT).load_model()
        from raven_convert.train.models import load_hybrid
        hybrid = load_hybrid(OUT)
    """,
}


@pytest.fixture(scope="module")
def hybrid_dir(tiny_sources, tmp_path_factory):
    out = tmp_path_factory.mktemp("load_order") / "hybrid"
    args = ["--src", str(tiny_sources["llama"]), "--out", str(out), "--mixer", "raven", "--layers", "0"]
    assert (
        convert_main([*args, "--raven-num-slots", "8", "--raven-top-k", "2", "--mixer", "sila", "--layers", "2"]) == 0
    )
    return out


@pytest.mark.parametrize("order", sorted(ORDERS))
def test_the_stages_load_the_toolkits_hybrid_whatever_came_first(hybrid_dir, tmp_path, order):
    code = textwrap.dedent(ORDERS[order]) + textwrap.dedent(
        """
        import torch
        import raven_layers
        ids = torch.tensor([[5, 9, 14, 3, 22, 7]])
        with torch.no_grad():
            result["same"] = torch.equal(first.eval()(ids).logits, hybrid.eval()(ids).logits)
        result["first"] = type(first).__module__
        result["ours"] = type(hybrid) is raven_layers.HybridForCausalLM
        """
    )
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = os.environ | {"PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": ""}
    result = run_python(f"OUT = {str(hybrid_dir)!r}\n" + code, tmp_path, env)
    carried = order == "the directory's own code first"
    assert result["first"].startswith("transformers_modules.") == carried, result
    assert result["ours"] and result["same"], result

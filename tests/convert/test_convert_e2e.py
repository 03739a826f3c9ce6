"""`convert` end to end on tiny random models of every supported architecture."""

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from raven_convert import build_hybrid, plan_layers
from raven_convert.cli import main
from raven_layers import BUNDLED_FILES, output_cache
from tests.helpers import REPO, run_without_toolkit

SPECS = {"llama": "0,-1", "qwen3": "0-23:5", "mistral": "1-3", "qwen2": "all"}
RAVEN = ["--raven-num-slots", "16", "--raven-top-k", "4", "--raven-chunk-size", "4"]
IDS = [[5, 17, 33, 2, 9, 41, 8, 8, 63, 12, 7], [44, 3, 19, 27, 51, 6, 30, 11, 9, 70, 4]]


def convert_tiny(tiny_sources, tmp_path, arch, spec, *extra):
    out = tmp_path / f"{arch}-hybrid"
    assert (
        main(["--src", str(tiny_sources[arch]), "--mixer", "raven", "--layers", spec, "--out", str(out), *extra]) == 0
    )
    return out


@pytest.mark.parametrize("arch", sorted(SPECS))
def test_layers_none_is_the_source_model(tiny_sources, tmp_path, arch):
    out = convert_tiny(tiny_sources, tmp_path, arch, "none")
    source = AutoModelForCausalLM.from_pretrained(tiny_sources[arch]).eval()
    hybrid = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ids = torch.tensor(IDS)
    with torch.no_grad():
        assert torch.equal(hybrid(ids).logits, source(ids).logits)


@pytest.mark.transformers_api
@pytest.mark.parametrize("arch", sorted(SPECS))
def test_converted_directory_is_complete_and_reloads(tiny_sources, tmp_path, arch):
    out = convert_tiny(tiny_sources, tmp_path, arch, SPECS[arch], *RAVEN, "--seed", "3")
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors.index.json", "generation_config.json", "README.md"} <= files
    assert {"tokenizer.json", "model-mixers.safetensors", "model-base.safetensors"} <= files  # see weights.py
    assert set(BUNDLED_FILES) <= files

    config = json.loads((out / "config.json").read_text())
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_hybrid.HybridForCausalLM"
    assert config["base_model_type"] == arch and config["hidden_size"] == 64
    source = AutoModelForCausalLM.from_pretrained(tiny_sources[arch]).eval()
    kinds = plan_layers([("raven", SPECS[arch])], source.config.num_hidden_layers)
    assert config["layer_mixers"] == kinds
    assert config["mixer_settings"]["raven"]["num_slots"] == 16 and config["mixer_settings"]["raven"]["top_k"] == 4

    card = (out / "README.md").read_text()
    assert f"base_model: {tiny_sources[arch]}" in card and "- raven-hybrid" in card
    assert f"| {kinds.index('raven')} | raven |" in card and "trust_remote_code=True" in card
    assert "- raven layer: constant state of 4 KiB" in card  # 2 x [H_kv=2, M=16, d=16] float32

    expected = build_hybrid(source, kinds, {"raven": {"num_slots": 16, "top_k": 4, "chunk_size": 4}}, seed=3)
    reloaded = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ids = torch.tensor(IDS)
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, expected(ids).logits, rtol=0, atol=0)
        generated = reloaded.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert generated.shape == (2, 15)


MIXED = [
    "--mixer",
    "sse",
    "--layers",
    "1-23:5",
    "--mixer",
    "sila",
    "--layers",
    "2-23:5",
    *RAVEN,
    "--sse-lora-rank",
    "8",
    "--sse-top-k",
    "2",
    "--sse-chunk-size",
    "4",
    "--sila-chunk-size",
    "4",
]


@pytest.mark.transformers_api
def test_standalone_load_without_the_toolkit(tiny_sources, tmp_path):
    # all three mixers in one model, loaded where only transformers is installed
    out = convert_tiny(tiny_sources, tmp_path, "qwen3", "0-23:5", *MIXED)
    kinds = json.loads((out / "config.json").read_text())["layer_mixers"]
    assert kinds[:6] == ["raven", "sse", "sila", "attention", "attention", "raven"]
    reference = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    with torch.no_grad():
        logits = reference(torch.tensor(IDS)).logits
        greedy = reference.generate(torch.tensor(IDS), max_new_tokens=6, do_sample=False, pad_token_id=0)
    result = run_without_toolkit(
        f"""
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
        tokenizer = AutoTokenizer.from_pretrained({str(out)!r}, trust_remote_code=True)
        ids = torch.tensor({IDS})
        with torch.no_grad():
            result["logits"] = model(ids).logits.tolist()
            result["greedy"] = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0).tolist()
            prompt = tokenizer("hello", return_tensors="pt")
            result["text"] = tokenizer.decode(model.generate(**prompt, max_new_tokens=5, do_sample=False)[0])
        result["class_module"] = type(model).__module__
        """,
        cwd=tmp_path,
    )
    assert result["class_module"].startswith("transformers_modules.")
    torch.testing.assert_close(torch.tensor(result["logits"]), logits, rtol=1e-6, atol=1e-6)
    assert result["greedy"] == greedy.tolist()
    assert result["text"].startswith("hello")


def test_exported_model_runs_the_installed_kernels(tiny_sources, tmp_path):
    # a process that loads the model's own code (not the toolkit's classes) where the toolkit is installed: the
    # model's backend.py imports its kernels by their installed names (on CPU in the Triton interpreter)
    mixers = ["--mixer", "sse", "--layers", "1", "--mixer", "sila", "--layers", "2", *MIXED[8:]]
    out = convert_tiny(tiny_sources, tmp_path, "llama", "0", *mixers)
    code = f"""
import importlib, json, sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True).eval()
mixer = type(model.model.layers[0].self_attn)
backend = importlib.import_module(mixer.__module__.rpartition(".")[0] + ".backend")
with torch.no_grad():
    with backend.use_backend("torch"):
        reference = model(torch.tensor({IDS})).logits
    with backend.use_backend("triton"):
        logits = model(torch.tensor({IDS})).logits
loaded = {{name: module.__file__ for name, module in backend._modules.items() if module is not None}}
print(json.dumps({{"backend": backend.__name__, "loaded": loaded, "error": (logits - reference).abs().max().item(),
                  "toolkit_classes": "raven_layers" in sys.modules}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["backend"].startswith("transformers_modules.") and not result["toolkit_classes"]
    assert sorted(result["loaded"]) == ["raven_kernels.raven", "raven_kernels.sila", "raven_kernels.sse"], result
    assert result["error"] < 1e-4


def test_sharded_weights(tiny_sources, tmp_path):
    out = convert_tiny(tiny_sources, tmp_path, "llama", "0-3:2", *RAVEN, "--max-shard-size", "100KB")
    assert (out / "model.safetensors.index.json").is_file()
    assert len(list(out.glob("model-base-*-of-*.safetensors"))) > 1
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert model.config.layer_mixers == ["raven", "attention", "raven", "attention"]


def test_overwrite_replaces_the_directory(tiny_sources, tmp_path):
    out = convert_tiny(tiny_sources, tmp_path, "llama", "0", *RAVEN)
    (out / "stale.txt").write_text("old")
    convert_tiny(tiny_sources, tmp_path, "llama", "1", *RAVEN, "--overwrite")
    assert not (out / "stale.txt").exists()
    assert json.loads((out / "config.json").read_text())["layer_mixers"][:2] == ["attention", "raven"]
    assert not list(tmp_path.glob(".*partial")) and not list(tmp_path.glob(".*old"))


def test_push_to_hub_uploads_the_output_directory(tiny_sources, tmp_path, monkeypatch):
    calls = []

    class FakeApi:
        def __init__(self, token=None):
            calls.append(("init", token))

        def create_repo(self, repo_id, **kwargs):
            calls.append(("create_repo", repo_id, kwargs))

        def upload_folder(self, folder_path, repo_id, **kwargs):
            calls.append(
                (
                    "upload_folder",
                    folder_path,
                    repo_id,
                    sorted(p.name for p in __import__("pathlib").Path(folder_path).iterdir()),
                )
            )

    monkeypatch.setattr("huggingface_hub.HfApi", FakeApi)
    out = convert_tiny(tiny_sources, tmp_path, "llama", "0", *RAVEN, "--push-to-hub", "me/tiny-raven", "--private")
    assert calls[1] == ("create_repo", "me/tiny-raven", {"repo_type": "model", "private": True, "exist_ok": True})
    assert calls[2][:3] == ("upload_folder", str(out), "me/tiny-raven")
    assert "modeling_hybrid.py" in calls[2][3] and "config.json" in calls[2][3]


@pytest.mark.parametrize(("arch", "qk_norm", "has_norm"), [("qwen3", "false", False), ("llama", "true", True)])
def test_qk_norm_can_be_dropped_or_added(tiny_sources, tmp_path, arch, qk_norm, has_norm):
    out = convert_tiny(tiny_sources, tmp_path, arch, "0", *RAVEN, "--raven-qk-norm", qk_norm)
    mixer = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).model.layers[0].self_attn
    assert hasattr(mixer, "q_norm") == has_norm


@pytest.mark.transformers_api
def test_bfloat16_export(tiny_sources, tmp_path):
    out = convert_tiny(tiny_sources, tmp_path, "llama", "0,2", *RAVEN, "--dtype", "bfloat16")
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    assert model.dtype == torch.bfloat16
    out = model.generate(
        torch.tensor(IDS), max_new_tokens=3, do_sample=False, pad_token_id=0, return_dict_in_generate=True
    )
    assert out.sequences.shape == (2, 14)
    assert all(
        s.dtype == torch.float32 for layer in output_cache(out).layers if hasattr(layer, "state") for s in layer.state
    )  # recurrent states accumulate in float32


def test_python_dash_m_raven_convert(tmp_path):
    command = [sys.executable, "-m", "raven_convert", "--help"]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, check=True)
    assert "--layers" in proc.stdout and "0-23:5" in proc.stdout


@pytest.mark.transformers_api
def test_sliding_window_attention_is_mistral_with_the_same_weights(tiny_sources, tmp_path):
    # Llama layers given a 4-token window compute what Mistral (Llama + sliding window) computes with those weights.
    out = convert_tiny(tiny_sources, tmp_path, "llama", "none", "--sliding-window", "4")
    hybrid = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    assert hybrid.model.windows == [4, 4, 4, 4]
    from tests.conftest import tiny_config

    mistral = AutoModelForCausalLM.from_config(tiny_config("mistral", sliding_window=4)).eval()
    mistral.load_state_dict(AutoModelForCausalLM.from_pretrained(tiny_sources["llama"]).state_dict())
    ids = torch.tensor(IDS)
    with torch.no_grad():
        torch.testing.assert_close(hybrid(ids).logits, mistral(ids).logits, rtol=1e-5, atol=1e-5)
        out = hybrid.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
        reference = mistral.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(out.sequences, reference)
    assert all(layer.stored_length() == 3 for layer in output_cache(out).layers)  # window - 1 keys kept


def test_window_layers_choose_which_attention_layers(tiny_sources, tmp_path):
    out = convert_tiny(tiny_sources, tmp_path, "llama", "0", *RAVEN, "--sliding-window", "5", "--window-layers", "2-3")
    config = json.loads((out / "config.json").read_text())
    assert config["attention_windows"] == [None, None, 5, 5]


@pytest.mark.transformers_api
def test_attention_sinks_are_converted_and_saved(tiny_sources, tmp_path):
    """`--attention-sinks` is recorded in config.json, and the loaded model keeps the sinks: its decode steps past
    the window equal its full forward, which differs from the bare window's (the model's own code carries sinks.py:
    test_standalone_load_without_the_toolkit)."""
    args = ("0", *RAVEN, "--sliding-window", "3", "--window-layers", "2", "--attention-sinks", "2")
    out = convert_tiny(tiny_sources, tmp_path, "llama", *args)
    assert json.loads((out / "config.json").read_text())["attention_sinks"] == 2
    card = (out / "README.md").read_text()
    assert "| 2 | attention (sliding window 3, 2 sinks) |" in card and "| 3 | attention |" in card
    saved = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    ids = torch.tensor(IDS)
    with torch.no_grad():
        full = saved(ids).logits
        out = saved(ids[:, :2], use_cache=True)
        steps, cache = [out.logits], output_cache(out)
        for t in range(2, ids.shape[1]):
            steps.append(saved(ids[:, t : t + 1], cache=cache, use_cache=True).logits)
        saved.set_attention_window(3, [2], sinks=0)
        bare = saved(ids).logits
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-4, atol=1e-5)
    assert (full[:, 4:] - bare[:, 4:]).abs().max() > 1e-4


def test_sse_with_its_own_row_count_gets_fresh_query_and_key_projections(tiny_sources, tmp_path):
    out = convert_tiny(
        tiny_sources,
        tmp_path,
        "llama",
        "none",
        "--mixer",
        "sse",
        "--layers",
        "1",
        "--sse-rows-per-partition",
        "8",
        "--sse-lora-rank",
        "4",
    )
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    mixer = model.model.layers[1].self_attn
    assert mixer.q_proj.weight.shape == (4 * 8, 64) and mixer.k_proj.weight.shape == (2 * 8, 64)
    source = AutoModelForCausalLM.from_pretrained(tiny_sources["llama"])
    assert torch.equal(mixer.v_proj.weight, source.model.layers[1].self_attn.v_proj.weight)


def test_mixer_pairs_in_one_call_are_recorded(tiny_sources, tmp_path):
    out = convert_tiny(
        tiny_sources,
        tmp_path,
        "llama",
        "0",
        "--mixer",
        "sila",
        "--layers",
        "1-2",
        "--mixer",
        "sse",
        "--layers",
        "3",
        *RAVEN,
        "--sse-lora-rank",
        "4",
    )
    config = json.loads((out / "config.json").read_text())
    assert config["layer_mixers"] == ["raven", "sila", "sila", "sse"]
    assert sorted(config["mixer_settings"]) == ["raven", "sila", "sse"]
    assert config["mixer_settings"]["sse"]["lora_rank"] == 4 and config["mixer_settings"]["sse"]["num_partitions"] == 4


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda c: c["layer_mixers"].append("attention"), "layer_mixers has 25 entries for 24 layers"),
        (lambda c: c["layer_mixers"].__setitem__(0, "mamba"), "layer_mixers[0] = 'mamba'; allowed"),
        (lambda c: c["mixer_settings"]["raven"].__setitem__("num_slots", 2), "raven.top_k = 4 is not allowed"),
    ],
)
def test_a_tampered_config_names_its_file(tiny_sources, tmp_path, edit, message):
    # loaded as users load it, without the toolkit: the bundled config class names config.json and the problem
    out = convert_tiny(tiny_sources, tmp_path, "qwen3", "0", "--raven-num-slots", "8", "--raven-top-k", "4")
    config = json.loads((out / "config.json").read_text())
    edit(config)
    (out / "config.json").write_text(json.dumps(config))
    result = run_without_toolkit(
        f"""
        from transformers import AutoModelForCausalLM
        try:
            AutoModelForCausalLM.from_pretrained({str(out)!r}, trust_remote_code=True)
        except ValueError as err:
            result["error"] = str(err)
        """,
        cwd=tmp_path,
    )
    assert result["error"].startswith(f"{out}/config.json: ") and message in result["error"]


ASK_AND_WARN = """
import logging
import transformers.models.auto.configuration_auto as config_auto
import transformers.models.auto.tokenization_auto as tokenizer_auto
result["asked"], result["warned"] = [], []
def refuse(trust, name, local, remote, *args, **kwargs):
    if trust is None and remote and not local:
        result["asked"].append(name)
        raise ValueError("answered no")  # as a "N" in a terminal
    return bool(trust)
config_auto.resolve_trust_remote_code = tokenizer_auto.resolve_trust_remote_code = refuse
class Record(logging.Handler):
    def emit(self, record):
        result["warned"].append(record.getMessage())
logging.getLogger("transformers").addHandler(Record(logging.WARNING))
logging.getLogger("transformers").setLevel(logging.WARNING)  # run_python sets TRANSFORMERS_VERBOSITY=error
"""


def snippet(markdown: str, name: str, out) -> str:
    return markdown.split("```python\n", 1)[1].split("```", 1)[0].replace(name, str(out))


@pytest.mark.transformers_api
@pytest.mark.parametrize("page", ["card", "readme"])
def test_the_documented_snippet_runs_without_the_toolkit_and_never_asks_nor_warns(tiny_sources, tmp_path, page):
    # transformers asks "Do you wish to run the custom code?" (15 s in a terminal) when remote code is needed and
    # trust_remote_code was not given, AutoTokenizer included (it reads config.json first): record every question
    # instead of answering it, and every warning, such as the one of a config read without its class
    out = convert_tiny(tiny_sources, tmp_path, "llama", "0", *RAVEN)
    if page == "card":
        code = snippet((out / "README.md").read_text(), "THIS_REPO_OR_DIR", out)
    else:
        code = snippet((REPO / "README.md").read_text(), "smollm2-sila", out)
    result = run_without_toolkit(ASK_AND_WARN + code + 'result["ran"] = True\n', cwd=tmp_path)
    assert result == {"asked": [], "warned": [], "ran": True}

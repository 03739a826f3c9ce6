"""save_trained: a trained hybrid with LoRA adapters is saved, a tensor at a time, as the directory that merging the
adapters into the whole model and saving it writes; each adapter is merged as soon as its module's tensors came, so
the stream never holds more than one module's. (Under fsdp the same path gathers each tensor as it comes:
test_distributed.py's launches end with one process's models.)"""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from raven_convert import build_hybrid, plan_layers
from raven_convert.export import save_hybrid
from raven_convert.train.distributed import Parallel
from raven_convert.train.lora import lora_modules, merge_lora, select_trainable
from raven_convert.train.models import _merged, load_hybrid, save_trained
from raven_convert.train.stage2_config import TrainConfig
from raven_convert.weights import INDEX, saved_names, tied_copies, whole_tensors

LORA = TrainConfig(steps=1, trainable="mixers+lora", lora_rank=4)


@pytest.fixture
def trained(tiny_sources, tmp_path):
    """(the converted model's directory, the hybrid loaded from it with LoRA adapters that change its weights)."""
    teacher = AutoModelForCausalLM.from_pretrained(tiny_sources["qwen2"]).eval()
    converted = tmp_path / "convert"
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_sources["qwen2"]))
    save_hybrid(build_hybrid(teacher, plan_layers([("sila", "1")], 4), {}), tokenizer, converted, base_model="tiny")
    model = load_hybrid(converted, "cpu")
    select_trainable(model, LORA)
    torch.manual_seed(1)
    with torch.no_grad():
        for module in lora_modules(model).values():
            module.lora_B["default"].weight.normal_()  # drawn as zeros: a merge would change nothing
    return converted, model


def test_a_model_with_lora_saves_as_its_merged_whole(trained, tmp_path):
    converted, model = trained
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    save_trained(Parallel(), model, converted, tmp_path / "streamed", "tiny", lora=LORA)
    for name, tensor in model.state_dict().items():  # the model saved is left as it was (adapters not merged in)
        assert torch.equal(tensor, before[name]), name
    select_trainable(reference := load_hybrid(converted, "cpu"), LORA)
    reference.load_state_dict(model.state_dict())
    whole = merge_lora(reference)
    save_hybrid(whole, AutoTokenizer.from_pretrained(str(converted)), tmp_path / "whole", base_model="tiny")
    files = sorted(p.name for p in (tmp_path / "whole").glob("*.safetensors"))
    assert files == sorted(p.name for p in (tmp_path / "streamed").glob("*.safetensors"))
    for file in [*files, INDEX]:
        assert (tmp_path / "streamed" / file).read_bytes() == (tmp_path / "whole" / file).read_bytes(), file
    # the mixers' file is the converted one's, linked; the base weights changed with the adapters merged
    assert (tmp_path / "streamed" / "model-mixers.safetensors").stat().st_ino == (
        converted / "model-mixers.safetensors"
    ).stat().st_ino
    assert (tmp_path / "streamed" / "model-base.safetensors").read_bytes() != (
        converted / "model-base.safetensors"
    ).read_bytes()


def test_each_adapter_is_merged_as_soon_as_its_module_came(trained):
    _, model = trained
    pulled = []

    def counted():
        for i, pair in enumerate(whole_tensors(model)):
            pulled.append(i)
            yield pair

    names = [name for name in model.state_dict() if name not in tied_copies(model)]  # whole_tensors' order
    owner = {name: next((m for m in lora_modules(model) if name.startswith(f"{m}.")), None) for name in names}
    end = {owner[name]: i for i, name in enumerate(names) if owner[name]}  # an adapted module's last tensor
    # saved name -> the index of the last tensor it needs: its own, or its module's last for an adapted linear
    last = {name.replace(".base_layer.", "."): end.get(owner[name], i) for i, name in enumerate(names)}
    out = []
    for saved, _ in _merged(counted(), model, LORA):
        out.append(saved)
        assert pulled[-1] == last[saved], saved  # emitted before the stream went further than it needed
    assert out == [s for s in saved_names(model).values()]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_model_on_a_gpu_saves_as_it_does_from_the_cpu(trained, tmp_path):
    converted, model = trained
    save_trained(Parallel(), model, converted, tmp_path / "cpu", "tiny", lora=LORA)
    save_trained(Parallel(), model.cuda(), converted, tmp_path / "gpu", "tiny", lora=LORA)
    for file in ["model-base.safetensors", "model-mixers.safetensors", INDEX]:
        assert (tmp_path / "gpu" / file).read_bytes() == (tmp_path / "cpu" / file).read_bytes(), file

"""The one switch between the Triton kernels and the PyTorch forms."""

import pytest
import torch

from raven_layers import backend


def test_auto_runs_pytorch_on_cpu_and_float64(monkeypatch):
    monkeypatch.delenv(backend.ENV_VAR, raising=False)
    assert backend.get_backend() == "auto"
    assert backend.kernel_module("raven_kernels.raven", torch.zeros(1)) is None
    cuda_float64 = torch.empty(1, dtype=torch.float64, device="meta")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    assert backend.kernel_module("raven_kernels.raven", cuda_float64) is None
    assert backend.kernel_module("raven_kernels.raven", torch.empty(1, device="meta")) is not None


def test_triton_and_torch_are_forced(monkeypatch):
    with backend.use_backend("triton"):
        assert backend.kernel_module("raven_kernels.sila", torch.zeros(1)).__name__ == "raven_kernels.sila"
        with backend.use_backend("torch"):
            assert backend.kernel_module("raven_kernels.sila", torch.zeros(1)) is None
        assert backend.get_backend() == "triton"  # restored on exit
    monkeypatch.setenv(backend.ENV_VAR, "torch")
    assert backend.get_backend() == "torch"


def test_bad_names_are_refused(monkeypatch):
    monkeypatch.setenv(backend.ENV_VAR, "cuda")
    with pytest.raises(
        ValueError, match=r"RAVEN_BACKEND = 'cuda' is not a backend; allowed: \['auto', 'triton', 'torch'\]"
    ):
        backend.get_backend()
    with pytest.raises(ValueError, match=r"backend = 'fast' is not a backend"):
        backend.set_backend("fast")


def test_forcing_kernels_that_cannot_import_is_an_error(monkeypatch):
    monkeypatch.setitem(backend._modules, "raven_kernels.raven", None)
    with backend.use_backend("triton"), pytest.raises(RuntimeError, match="raven_kernels.raven cannot be imported"):
        backend.kernel_module("raven_kernels.raven", torch.zeros(1))
    with backend.use_backend("auto"):
        assert backend.kernel_module("raven_kernels.raven", torch.zeros(1)) is None

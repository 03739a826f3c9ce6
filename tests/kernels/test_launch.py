"""The decode kernels' launch settings (kernels/launch.py): programmatic dependent launch only where set, and only on
a GPU that has it."""

from __future__ import annotations

import torch

from raven_kernels.launch import DEPENDENT_LAUNCH, LaunchSetting, dependent_launch


def test_a_launch_setting_is_its_default_outside_use():
    setting = LaunchSetting(3)
    with setting.use(5) as value:
        assert value == setting.value == 5
    assert setting.value == 3


def test_dependent_launch_needs_the_setting_and_compute_capability_9(monkeypatch):
    """Off unless DEPENDENT_LAUNCH is set, never on a CPU (the interpreter has no grid dependency control), and on
    CUDA only from Hopper on; the kernel's PDL flag and Triton's launch_pdl always agree."""
    capability = {"value": (9, 0)}
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability["value"])
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    off, on = {"PDL": False, "launch_pdl": False}, {"PDL": True, "launch_pdl": True}
    assert dependent_launch(cuda) == off
    with DEPENDENT_LAUNCH.use(True):
        assert dependent_launch(cuda) == on
        assert dependent_launch(cpu) == off
        capability["value"] = (8, 0)
        assert dependent_launch(cuda) == off
    assert DEPENDENT_LAUNCH.value is False

"""The Triton interpreter's tl.dot as an NVIDIA GPU rounds it, so that CPU runs catch what only a GPU's precision
shows: float32 operands enter the tensor cores as tf32 (their top 19 bits), "tf32x3" splits each into a tf32 head and
a tf32 tail and adds three products; "ieee" and bf16/fp16 operands stay exact, as on the GPU.

    def test_x(monkeypatch):
        round_dots_as_a_gpu(monkeypatch)   # on a CUDA host: nothing to do, the hardware rounds
"""

import numpy as np
import torch
from triton._C.libtriton import ir
from triton.runtime import interpreter


def tf32(x: np.ndarray) -> np.ndarray:
    """x (float32) with the 13 low mantissa bits a tensor core ignores cleared."""
    return (x.astype(np.float32).view(np.uint32) & np.uint32(0xFFFFE000)).view(np.float32)


def round_dots_as_a_gpu(monkeypatch) -> None:
    """Patch the interpreter's dot, for the test's duration (monkeypatch undoes it)."""
    if torch.cuda.is_available():
        return
    exact = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.data.dtype != np.float32 or b.data.dtype != np.float32:
            return exact(self, a, b, d, input_precision, max_num_imprecise_acc)
        if input_precision == ir.INPUT_PRECISION.TF32:
            out = np.matmul(tf32(a.data), tf32(b.data))
        elif input_precision == ir.INPUT_PRECISION.TF32x3:
            a_hi, b_hi = tf32(a.data), tf32(b.data)
            out = np.matmul(a_hi, b_hi) + np.matmul(a_hi, tf32(b.data - b_hi)) + np.matmul(tf32(a.data - a_hi), b_hi)
        else:
            return exact(self, a, b, d, input_precision, max_num_imprecise_acc)
        return interpreter.TensorHandle(out.astype(np.float32) + d.data, d.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)

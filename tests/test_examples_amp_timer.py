"""The examples' mixed-precision settings and step timer (examples/kron_examples_common.py).

``--amp-dtype`` picks autocast's dtype and whether a GradScaler runs (float16 only); the step
timer counts a block's host time on the CPU and, on CUDA, the device work queued inside it."""
from __future__ import annotations

import time

import pytest
import torch

from example_modules import load

common = load("examples/kron_examples_common.py")
char_lm = load("examples/char_lm.py")
CPU = torch.device("cpu")


def test_auto_is_bfloat16_without_a_scaler_on_the_cpu():
    amp = common.AmpState.create(True, CPU)
    assert amp.dtype == torch.bfloat16 and not amp.scaler.is_enabled()
    with amp.autocast():
        out = torch.nn.Linear(4, 4)(torch.randn(2, 4))
    assert out.dtype == torch.bfloat16


def test_float16_turns_the_scaler_on_and_bfloat16_leaves_it_off():
    half = common.AmpState.create(True, CPU, "float16")
    assert half.dtype == torch.float16 and half.scaler.is_enabled()
    brain = common.AmpState.create(True, CPU, "bfloat16")
    assert brain.dtype == torch.bfloat16 and not brain.scaler.is_enabled()
    assert not common.AmpState.create(False, CPU, "float16").scaler.is_enabled()  # amp off: no scaling


def test_an_unknown_amp_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="'fp8'"):
        common.AmpState.create(True, CPU, "fp8")


def test_amp_dtype_flag_reaches_the_training_config():
    args = char_lm.parse_args(["--amp", "--amp-dtype", "bfloat16"])
    _, train, _ = char_lm.configs_from_args(args)
    assert train.amp and train.amp_dtype == "bfloat16"
    _, default, _ = char_lm.configs_from_args(char_lm.parse_args([]))
    assert default.amp_dtype == "auto" and not default.amp


def test_cpu_timer_counts_the_block():
    with common.StepTimer(CPU) as timer:
        time.sleep(0.05)
    assert 0.05 <= timer.seconds < 5.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the CPU path is tested above)")
def test_cuda_timer_counts_queued_device_work():
    device = torch.device("cuda")
    torch.cuda._sleep(1000)  # context and kernel loaded outside the timed block
    torch.cuda.synchronize()
    host = time.perf_counter()
    with common.StepTimer(device) as timer:
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU cycles, returns at once on the host
    host = time.perf_counter() - host
    assert timer.seconds > 0.02  # the queued kernel, not the microseconds the host spent launching it
    assert timer.seconds <= host * 1.01

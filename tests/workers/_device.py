"""The device a test worker runs on: PARO_TEST_DEVICE=cuda puts each rank on cuda:LOCAL_RANK modulo the GPU count
(the GPU check, scripts/gpu_check.sh); the default is the CPU."""

import os

import torch


def test_device() -> torch.device:
    """The worker's device, made the default for new tensors and, for CUDA, the current device."""
    if os.environ.get("PARO_TEST_DEVICE", "cpu") == "cpu":
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
    torch.set_default_device(device)
    return device


def world_backend(device: torch.device) -> str:
    """The world group's backend: Gloo on the CPU; Gloo for CPU tensors and NCCL for CUDA tensors on a GPU."""
    return "gloo" if device.type == "cpu" else "cpu:gloo,cuda:nccl"

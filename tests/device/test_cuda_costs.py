"""Fixed CUDA costs: the stated defaults per GPU family and environment, and (on a GPU) the measured ones."""

import os

import pytest
import torch

from memfit.device.cuda_costs import (
    CONTEXT_EAGER,
    CONTEXT_LAZY,
    cublas_workspace,
    fixed_costs,
    gpu_family,
    measure_fixed_costs,
    nccl_buffers,
)

KiB, MiB = 1 << 10, 1 << 20


@pytest.mark.parametrize("capability, expected", [
    ((9, 0), 32 * MiB), ((10, 0), 32 * MiB), ((12, 0), 32 * MiB),          # Hopper, Blackwell: 4096 KiB x 8
    ((8, 0), 4096 * KiB * 2 + 16 * KiB * 8), ((8, 9), 8_519_680), ((7, 5), 8_519_680),   # :4096:2:16:8
])
def test_cublas_workspace_default_by_compute_capability(capability, expected):
    nbytes, source = cublas_workspace(capability, {})
    assert nbytes == expected and source.startswith("stated default for compute capability")


@pytest.mark.parametrize("config, expected", [(":4096:8", 32 * MiB), (":16:8", 128 * KiB),
                                              (":4096:2:16:8", 8_519_680)])
def test_cublas_workspace_config_sums_size_times_count(config, expected):
    nbytes, source = cublas_workspace((8, 0), {"CUBLAS_WORKSPACE_CONFIG": config})
    assert nbytes == expected and config in source


def test_an_unreadable_cublas_workspace_config_falls_back_as_torch_does_and_says_so():
    nbytes, source = cublas_workspace((9, 0), {"CUBLAS_WORKSPACE_CONFIG": "4096x8"})
    assert nbytes == 32 * MiB and "unreadable" in source


def test_fixed_costs_name_each_term_with_its_source():
    costs = {c.name: c for c in fixed_costs("NVIDIA A100-SXM4-80GB", threads=2, streams=2, environ={})}
    assert costs["CUDA context"].nbytes == CONTEXT_LAZY and not costs["CUDA context"].in_allocator
    ws = costs["cuBLAS workspace"]
    assert (ws.nbytes, ws.count, ws.in_allocator) == (4 * 8_519_680, 4, True) and "8.125 MiB" in ws.source
    eager = fixed_costs("T4", environ={"CUDA_MODULE_LOADING": "EAGER"})[0]
    assert eager.nbytes == CONTEXT_EAGER and "eager" in eager.source
    split = fixed_costs("H100", threads=1, environ={"TORCH_CUBLASLT_UNIFIED_WORKSPACE": "0"})
    assert [(c.name, c.nbytes) for c in split[1:]] == [("cuBLAS workspace", 32 * MiB), ("cuBLASLt workspace", MiB)]


@pytest.mark.parametrize("name, family", [
    ("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H200", "H200"), ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
    ("NVIDIA A100 80GB PCIe", "A100-80GB"), ("NVIDIA L4", "L4"), ("NVIDIA L40S", "L40S"), ("Tesla T4", "T4"),
    ("NVIDIA GeForce RTX 4090", "RTX 4090"), ("NVIDIA GeForce RTX 3090", "RTX 3090"),
])
def test_gpu_family_from_torchs_device_names(name, family):
    assert gpu_family(name).name == family


def test_gpu_family_by_capability_and_unknown_names():
    assert gpu_family((9, 0)).capability == (9, 0)
    with pytest.raises(ValueError, match="unknown GPU 'Voodoo 5'.*compute capability"):
        gpu_family("Voodoo 5")


def test_nccl_buffers_are_an_estimate_and_read_nccl_buffsize():
    est = nccl_buffers(channels=8, environ={})
    assert (est.nbytes, est.exact, est.in_allocator) == (4 * MiB * 2 * 8 * 2, False, False)
    assert nccl_buffers(channels=8, environ={"NCCL_BUFFSIZE": str(MiB)}).nbytes == MiB * 2 * 8 * 2


def test_measuring_without_a_gpu_says_what_to_use_instead():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: measure_fixed_costs measures")
    with pytest.raises(RuntimeError, match="use fixed_costs"):
        measure_fixed_costs()


@pytest.mark.cuda
def test_measured_cublas_workspace_is_the_stated_default():
    if "CUBLAS_WORKSPACE_CONFIG" in os.environ:
        pytest.skip("CUBLAS_WORKSPACE_CONFIG is set: the stated default does not apply")
    context, workspace = measure_fixed_costs()
    stated, _ = cublas_workspace(torch.cuda.get_device_capability(), os.environ)
    assert workspace.nbytes == stated
    assert 100 * MiB < context.nbytes < 4 << 30, context     # a context, and not much else on the device


def test_gpu_family_by_memory_takes_the_largest_stated_defaults_and_names_the_others():
    eighty = gpu_family(80 << 30)
    assert eighty.capability == (9, 0) and "H100" in eighty.name and "A100-80GB" in eighty.name
    assert gpu_family(24 << 30).capability[0] == 8 and gpu_family(24 << 30).memory == 24 << 30
    odd = gpu_family(20 << 30)
    assert odd.capability == (9, 0) and "no family of the table has it" in odd.name
    with pytest.raises(ValueError, match="expected a GPU's memory in bytes above 0; found 0"):
        gpu_family(0)

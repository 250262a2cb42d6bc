"""cluster=auto on a real GPU: the probe reads this device's name, memory and links, and the short
measurement an unknown chip gets reaches a sensible share of a known chip's table numbers.
Skipped without a GPU (``bash benchmarks/gpu_first_contact.sh`` runs it on one)."""

from __future__ import annotations

import pytest
import torch

from nereus_lightning.lightning.devices import auto_cluster, copy_rate, gemm_rate, probe_device
from nereus_lightning.spec.cluster import chip_of

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_the_probe_reads_this_gpu_and_names_the_cluster_for_it():
    props = torch.cuda.get_device_properties(0)
    facts = probe_device(0)
    assert facts.name == torch.cuda.get_device_name(0) and facts.memory == props.total_memory
    cluster = auto_cluster(True, 1, 1)
    assert cluster.name.startswith(facts.name) and cluster.gpu_memory == props.total_memory
    print(cluster.describe(), facts)


def test_the_measurement_reaches_a_known_chips_table_numbers():
    chip = chip_of(torch.cuda.get_device_name(0))
    if chip is None:
        pytest.skip(f"{torch.cuda.get_device_name(0)} is not in the chip table")
    device = torch.device("cuda", 0)
    flops, hbm = gemm_rate(device), copy_rate(device)
    print(
        f"{chip.name}: GEMM {flops / 1e12:.0f} TFLOP/s of {chip.peak_flops / 1e12:.0f}, "
        f"copy {hbm / 1e9:.0f} GB/s of {chip.hbm_bw / 1e9:.0f}"
    )
    assert 0.3 * chip.peak_flops < flops < 1.05 * chip.peak_flops
    assert 0.3 * chip.hbm_bw < hbm < 1.05 * chip.hbm_bw

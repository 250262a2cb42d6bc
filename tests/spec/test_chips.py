"""``cluster=auto`` on the brain's side: a device's name and links (as torch and NVML report them) make
the cluster spec; known chips take the table's FLOP/s and HBM bandwidth, unknown ones their measurement."""

from __future__ import annotations

import pytest

from nereus_lightning.plan.memory import memory_cap
from nereus_lightning.spec import CLUSTER_PRESETS, NereusConfigError
from nereus_lightning.spec.cluster import GB, PCIE_LANE_BW, DeviceFacts, chip_of, cluster_from_devices

#: Names as torch.cuda.get_device_name gives them on each machine, and the chip they are.
REPORTED = {
    "NVIDIA H100 80GB HBM3": "H100 SXM",
    "NVIDIA H100 PCIe": "H100 PCIe",
    "NVIDIA H100 NVL": "H100 NVL",
    "NVIDIA H200": "H200",
    "NVIDIA H200 NVL": "H200 NVL",
    "NVIDIA A100-SXM4-80GB": "A100 SXM 80GB",
    "NVIDIA A100-SXM4-40GB": "A100 SXM 40GB",
    "NVIDIA A100 80GB PCIe": "A100 PCIe 80GB",
    "NVIDIA A100-PCIE-40GB": "A100 PCIe 40GB",
    "NVIDIA L40S": "L40S",
    "NVIDIA B200": "B200",
    "AMD Instinct MI300X": "MI300X",
}


@pytest.mark.parametrize("reported, chip", REPORTED.items())
def test_reported_names_find_their_chip(reported, chip):
    assert chip_of(reported).name == chip


def test_names_no_entry_describes_find_none():
    for name in ("NVIDIA GeForce RTX 4090", "NVIDIA GH200 480GB", "NVIDIA L40", "Tesla V100-SXM2-32GB"):
        assert chip_of(name) is None


def test_an_h100_node_is_its_own_memory_and_nvlinks():
    """80 GB HBM3 H100s with 18 NVLink-4 links each, 2 nodes of 4 as the launch shapes them."""
    facts = DeviceFacts("NVIDIA H100 80GB HBM3", 85_045_477_376.0, nvlinks=18, nvlink_version=4)
    cluster = cluster_from_devices(facts, num_nodes=2, gpus_per_node=4)
    assert (cluster.num_nodes, cluster.gpus_per_node, cluster.num_gpus) == (2, 4, 8)
    assert (cluster.gpu_memory, cluster.peak_flops, cluster.hbm_bw) == (85_045_477_376.0, 989e12, 3.35e12)
    assert cluster.intra_bw == 900 * GB and cluster.inter_bw == CLUSTER_PRESETS["h200x8"].inter_bw
    assert cluster.describe().startswith("2 nodes x 4 GPUs (NVIDIA H100 80GB HBM3), 85.05 GB per GPU")
    # The plan's cap is the allocator's share: 10% and the CUDA context's 1 GiB off the device's memory.
    assert memory_cap(cluster) == pytest.approx(0.9 * 85_045_477_376.0 - 2**30)


def test_without_nvlink_the_pcie_link_prices_the_node():
    facts = DeviceFacts("NVIDIA L40S", 48e9, pcie_gen=4, pcie_width=16)
    assert cluster_from_devices(facts, 1, 2).intra_bw == 2 * 16 * PCIE_LANE_BW[4]
    # Without NVML (ROCm): the chip's own link from the table.
    assert cluster_from_devices(DeviceFacts("AMD Instinct MI300X", 206e9), 1, 8).intra_bw == 896 * GB


def test_an_unknown_chip_is_priced_on_its_measured_rates():
    facts = DeviceFacts("NVIDIA GeForce RTX 4090", 25.4e9, measured_flops=1.5e14, measured_hbm_bw=0.9e12)
    cluster = cluster_from_devices(facts, 1, 1)
    assert (cluster.peak_flops, cluster.hbm_bw) == (1.5e14, 0.9e12)
    assert cluster.name == "NVIDIA GeForce RTX 4090, measured"


def test_an_unknown_chip_without_a_measurement_names_the_way_out():
    match = r"cluster=auto: 'Mystery GPU' is not a known chip .* set cluster="
    with pytest.raises(NereusConfigError, match=match):
        cluster_from_devices(DeviceFacts("Mystery GPU", 1e10), 1, 1)


def test_every_chip_preset_is_one_eight_gpu_node():
    for name, chip in {
        "h100x8": "H100",
        "a100x8": "A100",
        "h200x8": "H200",
        "l40sx8": "L40S",
        "b200x8": "B200",
        "mi300x8": "MI300X",
    }.items():
        preset = CLUSTER_PRESETS[name]
        assert (preset.num_nodes, preset.gpus_per_node) == (1, 8) and preset.name.startswith(chip)
    h200 = CLUSTER_PRESETS["h200x8"]  # unchanged by the table it is now built from
    assert (h200.name, h200.gpu_memory, h200.peak_flops, h200.hbm_bw, h200.intra_bw) == (
        "H200 x8 node",
        141 * GB,
        989e12,
        4.8e12,
        900 * GB,
    )

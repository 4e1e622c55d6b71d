"""Datasheet numbers of the GPU machines the presets describe, and the efficiencies they assume.

A ``links.LinkModel`` preset is built from these (``links.from_hardware``); a measured model
(``lightning_twod/hardware/probe.py``) needs none of them. Every number carries its unit and its source;
those marked ASSUMPTION were not measured in this project and are listed in ``docs/planner.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

GB = 1e9  # bytes (vendor datasheets quote decimal units)

# --------------------------------------------------------------------- efficiency factors
#: Fraction of peak HBM bandwidth a fused embedding lookup (random row gathers of 16-512 B rows,
#: scatter-updates in backward) reaches. ASSUMPTION: FBGEMM's TBE kernels are memory bound; we
#: take 35 % of peak, a conservative figure for row gathers, not measured here (no GPU).
LOOKUP_HBM_EFFICIENCY = 0.35
#: Fraction of peak link bandwidth NCCL's all-to-all reaches with MB-sized messages.
#: ASSUMPTION (not measured here); all-to-all is usually below all-reduce's bus efficiency.
ALL_TO_ALL_EFFICIENCY = 0.7
#: Fraction of peak link bandwidth a ring/tree all-reduce reaches with large buffers.
#: ASSUMPTION (not measured here), of the order nccl-tests report for large messages.
ALL_REDUCE_EFFICIENCY = 0.8
#: Fraction of peak dense BF16 throughput the dense layers (MLPs, interaction) reach.
#: ASSUMPTION: recommendation MLPs are small and latency bound; 35 % model FLOP utilization.
DENSE_MFU = 0.35
#: Fraction of peak HBM bandwidth a streaming copy or element-wise kernel (the reduction's
#: gathers, bf16 conversions and updates) reaches. ASSUMPTION: streaming kernels reach well above
#: the random row gathers of a lookup.
COPY_HBM_EFFICIENCY = 0.7
#: Share of an NCCL all-reduce's time that the compute it overlaps still pays (``LinkModel.
#: overlap_share``). ASSUMPTION: NCCL moves data with a few SMs and the NIC, so compute beside it
#: loses little; taken as 0 (hidden entirely), not measured here (no GPU).
NCCL_OVERLAP_SHARE = 0.0


@dataclass(frozen=True)
class Hardware:
    """Per-GPU numbers of one kind of machine. Bandwidths are bytes/s in one direction."""

    name: str
    memory_bytes: float  # bytes of device memory per GPU
    hbm_bandwidth: float  # bytes/s, peak
    intra_node_bandwidth: float  # bytes/s per GPU to the other GPUs of its node (NVLink/NVSwitch)
    inter_node_bandwidth: float  # bytes/s per GPU to other nodes (its share of the node's NICs)
    intra_node_latency: float  # s per collective inside a node
    inter_node_latency: float  # s per remote peer message of a collective
    dense_flops: float  # FLOP/s, peak dense BF16
    gpus_per_node: int = 8


# NVIDIA H100 SXM5 80 GB in a DGX/HGX H100 node:
#   memory 80 GB HBM3, 3.35 TB/s; NVLink 4 900 GB/s bidirectional = 450 GB/s per direction;
#   989 TFLOPS dense BF16 -- NVIDIA H100 Tensor Core GPU datasheet (SXM column).
#   8 x ConnectX-7 NDR 400 Gb/s (one per GPU) = 50 GB/s per GPU -- NVIDIA DGX H100 datasheet.
#   Latencies: ASSUMPTION, 10 us per intra-node collective (order of NCCL's small-message time
#   on NVSwitch) and 3 us per remote peer message (one RDMA send/recv pair), not measured here.
H100 = Hardware("h100", 80 * GB, 3.35e12, 450 * GB, 50 * GB, 10e-6, 3e-6, 989e12)
# NVIDIA A100 SXM4 40 GB in an AWS p4d.24xlarge:
#   memory 40 GB HBM2, 1,555 GB/s; NVLink 3 600 GB/s bidirectional = 300 GB/s per direction;
#   312 TFLOPS dense BF16 -- NVIDIA A100 Tensor Core GPU datasheet.
#   400 Gb/s EFA per instance (AWS EC2 P4 instance page) / 8 GPUs = 6.25 GB/s per GPU.
#   Latencies: ASSUMPTION as above, with 10 us per remote message (EFA's SRD transport is slower
#   per message than InfiniBand verbs).
A100_P4D = Hardware("a100-p4d", 40 * GB, 1.555e12, 300 * GB, 6.25 * GB, 10e-6, 10e-6, 312e12)
HARDWARE = {hw.name: hw for hw in (H100, A100_P4D)}

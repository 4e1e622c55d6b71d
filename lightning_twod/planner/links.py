"""What the step-time model knows about a cluster: its links and the compute speed of a rank.

A ``LinkModel`` holds, for the all-to-all and the all-reduce, the bandwidth and latency inside a
node and across nodes, three compute throughputs of one rank (embedding row traffic of a
lookup, streaming copies, dense FLOPs), and the share of a collective's time that compute running
beside it still pays (``overlap_share``: near 0 where the collective runs on engines of its own,
NCCL's copy engines and NIC; near 1 where it runs on the cores that compute, gloo on a CPU).

Every bandwidth is what one rank gets **while every rank of its node runs the same collective at
once** (its share of the node's links), which is how the layouts use them: a shard group's
all-to-all runs in every group at the same time. Across nodes the node's link capacity is
therefore ``inter_node.bandwidth x ranks_per_node``.

Where the numbers come from (``resolve_links``):

* measured at set-up by a short probe, repeated (``lightning_twod.hardware.probe.measure``; the strategy's
  default), or read from the links cache where an earlier set-up on the same hosts measured them
  (``link_cache.py``): the model holds the field-wise fastest of the repeats (``fastest_of``: noise
  on a host only adds time), and the repeats themselves (``samples``), on each of which the layout
  choice predicts every candidate too;
* a YAML file written by ``python -m lightning_twod calibrate`` (``LinkModel.load``);
* a named preset for planning offline (``PRESETS``: the datasheet numbers and efficiency
  ASSUMPTIONS of ``hardware.py``).

This module is arithmetic and file I/O only (no process group): the probe lives in
``lightning_twod/hardware/probe.py``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_twod.planner.hardware import (
    A100_P4D,
    ALL_REDUCE_EFFICIENCY,
    ALL_TO_ALL_EFFICIENCY,
    COPY_HBM_EFFICIENCY,
    DENSE_MFU,
    H100,
    LOOKUP_HBM_EFFICIENCY,
    NCCL_OVERLAP_SHARE,
    Hardware,
)

#: YAML fields and their units as (SI = value * multiplier / divisor): bandwidths in GB/s (1e9
#: bytes/s), latencies in microseconds, FLOP rates in TFLOP/s.
_COLLECTIVE_FIELDS = {"bandwidth_gbps": (1e9, 1.0), "latency_us": (1.0, 1e6)}
_COMPUTE_FIELDS = {"lookup_gbps": (1e9, 1.0), "copy_gbps": (1e9, 1.0), "dense_tflops": (1e12, 1.0)}


@dataclass(frozen=True)
class CollectiveCost:
    """One collective over one class of link.

    ``bandwidth``: bytes/s a rank sends (every rank of its node doing the same at once);
    ``latency``: seconds of one call with negligible payload (all-to-all: per call inside a node,
    per remote peer across nodes; all-reduce: per round of its ``2 log2(group)`` rounds).
    """

    bandwidth: float
    latency: float

    def __post_init__(self) -> None:
        if not (self.bandwidth > 0 and math.isfinite(self.bandwidth)) or not (self.latency >= 0):
            raise ValueError(f"bandwidth must be > 0 and finite and latency >= 0, got {self}")


@dataclass(frozen=True)
class LinkModel:
    """Links and compute of one kind of rank; see the module docstring."""

    all_to_all_intra: CollectiveCost
    all_to_all_inter: CollectiveCost
    all_reduce_intra: CollectiveCost
    all_reduce_inter: CollectiveCost
    lookup_bandwidth: float  # bytes/s of embedding rows a lookup reads or writes
    copy_bandwidth: float  # bytes/s moved by streaming copies and element-wise kernels
    dense_flops: float  # FLOP/s of dense layers (forward + backward)
    ranks_per_node: int  # ranks that shared a node's links when the bandwidths were taken
    #: Share of an all-reduce's seconds that compute overlapping it still pays (0: hidden
    #: entirely, 1: no faster than one after the other, above 1: slower, the two contending).
    overlap_share: float = 0.0
    name: str = "custom"
    source: str = ""
    #: The repeated probes this model was taken from (``fastest_of``); empty for one set of numbers.
    samples: tuple[LinkModel, ...] = field(default=(), compare=False, repr=False)

    def collective(self, kind: str, across_nodes: bool) -> CollectiveCost:
        """``kind``: ``"all_to_all"`` or ``"all_reduce"``."""
        return getattr(self, f"{kind}_{'inter' if across_nodes else 'intra'}")

    def node_link_capacity(self, kind: str) -> float:
        """Bytes/s one node sends to other nodes in total during collective ``kind``."""
        return self.collective(kind, True).bandwidth * self.ranks_per_node

    def describe(self) -> str:
        """Two lines: the four collectives and the compute, in the YAML's units."""
        parts = []
        for kind in ("all_to_all", "all_reduce"):
            for scope, across in (("intra", False), ("inter", True)):
                c = self.collective(kind, across)
                parts.append(f"{kind} {scope} {c.bandwidth / 1e9:.3g} GB/s {c.latency * 1e6:.3g} us")
        return (f"links {self.name} ({self.source or 'no source'}; {self.ranks_per_node} rank(s) per node): "
                + ", ".join(parts) + f"\n  compute per rank: lookup {self.lookup_bandwidth / 1e9:.3g} GB/s, copy "
                f"{self.copy_bandwidth / 1e9:.3g} GB/s, dense {self.dense_flops / 1e12:.3g} TFLOP/s; overlapped "
                f"collectives cost compute {self.overlap_share:.0%} of their time"
                + (f"\n  the fastest of {len(self.samples)} probes, field by field" if self.samples else ""))

    # ------------------------------------------------------------------ YAML
    def to_container(self) -> dict[str, Any]:
        def collective(c: CollectiveCost) -> dict[str, float]:
            return {"bandwidth_gbps": _round(c.bandwidth / 1e9), "latency_us": _round(c.latency * 1e6)}

        return {
            "name": self.name, "source": self.source, "ranks_per_node": self.ranks_per_node,
            "all_to_all": {"intra_node": collective(self.all_to_all_intra),
                           "inter_node": collective(self.all_to_all_inter)},
            "all_reduce": {"intra_node": collective(self.all_reduce_intra),
                           "inter_node": collective(self.all_reduce_inter)},
            "compute": {"lookup_gbps": _round(self.lookup_bandwidth / 1e9),
                        "copy_gbps": _round(self.copy_bandwidth / 1e9),
                        "dense_tflops": _round(self.dense_flops / 1e12)},
            "overlap_share": _round(self.overlap_share),
            **({"repeats": [_numbers(s.to_container()) for s in self.samples]} if self.samples else {}),
        }

    def to_yaml(self) -> str:
        import yaml

        return yaml.safe_dump(self.to_container(), sort_keys=False)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_yaml())

    @classmethod
    def from_container(cls, data: Any, where: str = "links") -> LinkModel:
        """From the YAML layout of ``to_container``; ``ValueError`` naming ``where`` and the field."""
        if not isinstance(data, Mapping):
            raise ValueError(f"{where}: expected a mapping with all_to_all, all_reduce, compute and "
                             f"ranks_per_node, got {type(data).__name__}")
        costs = {}
        for kind in ("all_to_all", "all_reduce"):
            for scope in ("intra_node", "inter_node"):
                values = {key: _field(data, (kind, scope, key), where) * mul / div
                          for key, (mul, div) in _COLLECTIVE_FIELDS.items()}
                try:
                    costs[f"{kind}_{scope.split('_')[0]}"] = CollectiveCost(values["bandwidth_gbps"],
                                                                             values["latency_us"])
                except ValueError as err:
                    raise ValueError(f"{where}: field {kind}.{scope}: {err}") from None
        compute = {key: _field(data, ("compute", key), where) * mul / div for key, (mul, div) in _COMPUTE_FIELDS.items()}
        for key, value in compute.items():
            if value <= 0:
                raise ValueError(f"{where}: field compute.{key} must be > 0, got {_field(data, ('compute', key), where)}")
        rpn = _field(data, ("ranks_per_node",), where)
        if rpn < 1 or rpn != int(rpn):
            raise ValueError(f"{where}: field ranks_per_node must be an int >= 1, got {rpn}")
        share = _field(data, ("overlap_share",), where)
        if share < 0:
            raise ValueError(f"{where}: field overlap_share must be >= 0, got {share}")
        repeats = data.get("repeats") or []
        if not isinstance(repeats, list):
            raise ValueError(f"{where}: field repeats must be a list of probes, got {type(repeats).__name__}")
        samples = tuple(cls.from_container({**r, "ranks_per_node": rpn} if isinstance(r, Mapping) else r,
                                           f"{where} repeats[{i}]") for i, r in enumerate(repeats))
        return cls(**costs, lookup_bandwidth=compute["lookup_gbps"], copy_bandwidth=compute["copy_gbps"],
                   dense_flops=compute["dense_tflops"], ranks_per_node=int(rpn), overlap_share=share,
                   name=str(data.get("name", "custom")), source=str(data.get("source", where)), samples=samples)

    @classmethod
    def load(cls, path: str | Path) -> LinkModel:
        """Read a file written by ``calibrate`` (or by hand); ``ValueError`` naming the file and field."""
        import yaml

        try:
            text = Path(path).read_text()
        except OSError as err:
            raise ValueError(f"links file {str(path)!r} cannot be read: {err.strerror or err}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise ValueError(f"links file {str(path)!r} is not valid YAML: {err}") from None
        return cls.from_container(data, where=f"links file {str(path)!r}")


def fastest_of(samples: Sequence[LinkModel], name: str, source: str) -> LinkModel:
    """Every number the best of ``samples`` (repeated probes of one cluster: the highest rate, the
    shortest latency, the lowest overlap share), which it keeps: what a host is busy with only adds
    time to a probe, so the fastest repeat is the closest to what the links can do."""
    def pick(how, attr: str, part: str | None = None) -> float:
        return how(getattr(getattr(s, attr), part) if part else getattr(s, attr) for s in samples)

    costs = {kind: CollectiveCost(pick(max, kind, "bandwidth"), pick(min, kind, "latency"))
             for kind in ("all_to_all_intra", "all_to_all_inter", "all_reduce_intra", "all_reduce_inter")}
    return LinkModel(**costs, lookup_bandwidth=pick(max, "lookup_bandwidth"), copy_bandwidth=pick(max, "copy_bandwidth"),
                     dense_flops=pick(max, "dense_flops"), ranks_per_node=samples[0].ranks_per_node,
                     overlap_share=pick(min, "overlap_share"), name=name, source=source, samples=tuple(samples))


def _numbers(container: dict[str, Any]) -> dict[str, Any]:
    """A probe's numbers in a file's ``repeats``: its collectives, compute and overlap share."""
    return {k: v for k, v in container.items() if k in ("all_to_all", "all_reduce", "compute", "overlap_share")}


def _round(x: float) -> float:
    return float(f"{x:.6g}")


def _field(data: Mapping, path: tuple[str, ...], where: str) -> float:
    node: Any = data
    for depth, key in enumerate(path):
        if not isinstance(node, Mapping) or key not in node:
            raise ValueError(f"{where}: missing field {'.'.join(path[:depth + 1])}")
        node = node[key]
    if isinstance(node, bool) or not isinstance(node, (int, float)) or not math.isfinite(node):
        raise ValueError(f"{where}: field {'.'.join(path)} must be a finite number, got {node!r}")
    return float(node)


def from_hardware(hardware: Hardware) -> LinkModel:
    """A preset from datasheet numbers and the efficiency ASSUMPTIONS of ``hardware.py``."""
    def cost(bandwidth: float, efficiency: float, latency: float) -> CollectiveCost:
        return CollectiveCost(bandwidth * efficiency, latency)

    return LinkModel(
        all_to_all_intra=cost(hardware.intra_node_bandwidth, ALL_TO_ALL_EFFICIENCY, hardware.intra_node_latency),
        all_to_all_inter=cost(hardware.inter_node_bandwidth, ALL_TO_ALL_EFFICIENCY, hardware.inter_node_latency),
        all_reduce_intra=cost(hardware.intra_node_bandwidth, ALL_REDUCE_EFFICIENCY, hardware.intra_node_latency),
        all_reduce_inter=cost(hardware.inter_node_bandwidth, ALL_REDUCE_EFFICIENCY, hardware.inter_node_latency),
        lookup_bandwidth=hardware.hbm_bandwidth * LOOKUP_HBM_EFFICIENCY,
        copy_bandwidth=hardware.hbm_bandwidth * COPY_HBM_EFFICIENCY,
        dense_flops=hardware.dense_flops * DENSE_MFU,
        ranks_per_node=hardware.gpus_per_node, overlap_share=NCCL_OVERLAP_SHARE, name=hardware.name,
        source="preset: datasheet numbers x efficiency assumptions (docs/planner.md)")


#: Named presets for planning offline (``links="h100"``).
PRESETS: dict[str, LinkModel] = {hw.name: from_hardware(hw) for hw in (H100, A100_P4D)}


def resolve_links(spec: LinkModel | str | Path | None, default: str = "h100") -> LinkModel:
    """A ``LinkModel`` from an instance, a preset name, or a YAML path (``None``: ``default``)."""
    if isinstance(spec, LinkModel):
        return spec
    if spec is None:
        return PRESETS[default]
    text = str(spec)
    if text in PRESETS:
        return PRESETS[text]
    path = Path(text)
    if path.suffix.lower() in (".yaml", ".yml") or path.exists() or "/" in text:
        return LinkModel.load(path)
    raise ValueError(f"links={text!r} is neither a preset ({', '.join(sorted(PRESETS))}), 'measure', nor a YAML "
                     "file written by `python -m lightning_twod calibrate`")

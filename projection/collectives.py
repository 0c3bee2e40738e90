"""Cost of one collective on a GPU cluster: a hierarchical alpha-beta model.

time = latency + transfer, minimised over the algorithms and protocols NCCL would
choose between (NCCL's tuner does the same: it predicts every (algorithm, protocol)
pair with such a model and runs the fastest).

Topology. `group_nodes[i]` is the node of the i-th member of ONE replica group, where a
"node" is an NVLink domain (8 GPUs on HGX, 72 on NVL72; use `domain_of`). From it:
    n = group size, k = nodes spanned, m = members per node (max / min over nodes).
Members of a node talk over NVLink; between nodes each GPU uses its own NIC(s) (rail
network), so the m members of a node share m NICs.

Bandwidths are *achievable* ones (hardware catalog), never line rates. Intra-node
figures are nccl-tests bus bandwidths, so the data each GPU moves follows nccl-tests'
conventions (nccl-tests doc/PERFORMANCE.md):
    all-reduce      2(n-1)/n x S     S = operand bytes per device
    all-gather       (n-1)/n x S     S = OUTPUT bytes per device (the gathered buffer)
    reduce-scatter   (n-1)/n x S     S = INPUT bytes per device (before scattering)
    all-to-all       (n-1)/n x S     S = operand bytes per device
    collective-permute        S     S = bytes sent per device (one message)

Groups spanning nodes are decomposed hierarchically: intra-node reduce-scatter, an
inter-node collective on the 1/m shard each GPU then holds (over its own NIC), and an
intra-node all-gather. NCCL pipelines the phases chunk by chunk (NVLSTree, Tree), so
the transfer time is that of the slower phase, not the sum; latencies add up. At scale
this gives busbw -> m x NIC bandwidth (376 GB/s for 8 x 47 GB/s on H100), the 370-380
GB/s NVIDIA reports for multi-node H100 all-reduce (hardware.md; GTC 2024 via
NVIDIA/nccl issue 1649). At 2-4 nodes it is more optimistic than a flat ring, whose
NIC carries 2(n-1)/n instead of 2(k-1)/k of the shard (sjeaugey, nccl-tests issue 196:
on two nodes NCCL's tree "can indeed go beyond the network bottleneck").

Latency follows NCCL's tuning model (hardware.Protocol): a base per call plus a cost
per pipeline step, the steps being ring hops over NVLink or the network, or tree levels.
Kernel launch is not included (the catalog's kernel_launch_us is for the caller).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

from hardware.catalog import Hardware, Protocol

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

# NCCL's tuner discounts Tree bus bandwidth to 92% (tuning.cc: busBw*.92).
TREE_EFFICIENCY = 0.92


@dataclass(frozen=True)
class CollectiveCost:
  """The chosen algorithm for one collective and its time split."""

  kind: str
  bytes: int
  group_size: int
  nodes: int
  members_per_node: int  # the largest count on any node
  algorithm: str  # e.g. "nvls", "ring", "ring+tree" (intra+inter), "p2p"
  protocol: str
  latency_s: float
  transfer_s: float

  @property
  def time_s(self) -> float:
    return self.latency_s + self.transfer_s


def normalize_kind(kind: str) -> str:
  """Canonical HLO collective name; accepts '_' for '-' and an async '-start' suffix."""
  k = kind.strip().lower().replace("_", "-")
  k = k.removesuffix("-start")
  if k not in KINDS:
    raise ValueError(f"unknown collective kind {kind!r}; known: {', '.join(KINDS)}")
  return k


def domain_of(device_id: int, hw: Hardware) -> int:
  """NVLink domain ("node" for this model) of a device, assuming devices are numbered
  domain by domain (as JAX numbers them host by host)."""
  return device_id // hw.nvlink_domain_size


def collective_time_s(
  kind: str, bytes: int, group_nodes: Sequence[int], hw: Hardware, operands: int = 1
) -> float:
  """Predicted seconds for one collective of `bytes` (see module doc for the
  convention per kind; all its `operands` together) over one replica group whose
  members sit on `group_nodes`."""
  return collective_cost(kind, bytes, group_nodes, hw, operands).time_s


def collective_cost(
  kind: str, bytes: int, group_nodes: Sequence[int], hw: Hardware, operands: int = 1
) -> CollectiveCost:
  """As collective_time_s, with the chosen algorithm/protocol and the time split. Each
  operand past the first adds hw.operand_latency_fraction of the latency (0 on GPUs)."""
  kind = normalize_kind(kind)
  counts = list(Counter(group_nodes).values())
  n, k = len(group_nodes), len(counts)
  m_max, m_min = (max(counts), min(counts)) if counts else (0, 0)
  if n <= 1 or bytes <= 0:  # nothing crosses a link
    return CollectiveCost(kind, bytes, n, k, m_max, "none", "none", 0.0, 0.0)
  if k > 1 and hw.nic_gb_s_per_gpu <= 0:
    raise ValueError(f"{hw.name} has no scale-out network, but the group spans {k} nodes")

  shape = _Shape(n=n, k=k, m_max=m_max, m_min=m_min, counts=tuple(counts))
  model = {
    "all-reduce": _all_reduce,
    "all-gather": _gather_scatter,
    "reduce-scatter": _gather_scatter,
    "all-to-all": _all_to_all,
    "collective-permute": _permute,
  }[kind]
  best: tuple[str, str, float, float] | None = None
  for proto in hw.protocols:
    for alg, lat_us, xfer_s in model(float(bytes), shape, hw, proto):
      if best is None or lat_us * 1e-6 + xfer_s < best[2] + best[3]:
        best = (alg, proto.name, lat_us * 1e-6, xfer_s)
  assert best is not None
  latency_s = best[2] * (1 + (operands - 1) * hw.operand_latency_fraction)
  return CollectiveCost(kind, bytes, n, k, m_max, best[0], best[1], latency_s, best[3])


def bus_bandwidth_gb_s(kind: str, bytes: int, group_size: int, time_s: float) -> float:
  """nccl-tests bus bandwidth of a measured or predicted call: algbw x bus factor."""
  return bytes / time_s / 1e9 * bus_factor(kind, group_size)


def bus_factor(kind: str, n: int) -> float:
  """Share of S each GPU must move (nccl-tests): 2(n-1)/n for all-reduce, etc."""
  kind = normalize_kind(kind)
  if kind == "collective-permute":
    return 1.0
  return (2.0 if kind == "all-reduce" else 1.0) * (n - 1) / n


# ---------------------------------------------------------------------------
# Per-kind candidates: each yields (algorithm, latency_us, transfer_s) for one protocol.
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Shape:
  n: int
  k: int
  m_max: int
  m_min: int
  counts: tuple[int, ...]


def _gb_s(x: float) -> float:
  return x * 1e9


def _net_bytes_s(hw: Hardware, p: Protocol, gpus: int) -> float:
  """Scale-out bandwidth of `gpus` GPUs of one node: each drives its own NIC rails."""
  return _gb_s(hw.nic_gb_s_per_gpu * p.bandwidth_fraction) * gpus


def _all_reduce(S: float, s: _Shape, hw: Hardware, p: Protocol):
  """Intra phase: ring (reduce-scatter + all-gather inside the node, 2(m-1) NVLink
  steps) or NVLS (the switch reduces; Simple protocol only, one fixed latency).
  Inter phase, on the S/m shard per GPU: ring (2(k-1) network steps, NIC carries
  2(k-1)/k of the shard) or double binary tree (2 log2 k levels, but every node sends
  and receives the whole shard twice: 2 x shard, NCCL's algbw = busbw/2)."""
  m = s.m_max
  intra = [
    (
      "ring",
      p.base_us + 2 * (m - 1) * p.nvlink_hop_us,
      _gb_s(hw.allreduce_ring_busbw_gb_s * p.bandwidth_fraction),
    )
  ]
  if (
    hw.allreduce_nvls_busbw_gb_s and hw.nvls_latency_us is not None and p.name == "simple" and m > 1
  ):
    intra.append(("nvls", hw.nvls_latency_us, _gb_s(hw.allreduce_nvls_busbw_gb_s)))
  for name, lat_us, bw in intra:
    t_intra = 2 * (m - 1) / m * S / bw
    if s.k == 1:
      yield name, lat_us, t_intra
      continue
    net = _net_bytes_s(hw, p, s.m_min)  # fewest GPUs -> fewest NICs for the node's S
    t_ring = 2 * (s.k - 1) / s.k * S / net
    yield f"{name}+ring", lat_us + 2 * (s.k - 1) * p.net_hop_us, max(t_intra, t_ring)
    t_tree = 2 * S / (net * TREE_EFFICIENCY)
    levels = math.ceil(math.log2(s.k))
    yield f"{name}+tree", lat_us + 2 * levels * p.tree_net_hop_us, max(t_intra, t_tree)


def _gather_scatter(S: float, s: _Shape, hw: Hardware, p: Protocol):
  """Ring, hierarchical: (m-1)/m of S over NVLink and (k-1)/k of the S/m shard over
  each GPU's NIC, pipelined; m-1 NVLink steps + k-1 network steps. NCCL has no tree
  for these; its NVLS variants are not modelled (ring bandwidth is used)."""
  m = s.m_max
  lat_us = p.base_us + (m - 1) * p.nvlink_hop_us + (s.k - 1) * p.net_hop_us
  t_intra = (m - 1) / m * S / _gb_s(hw.allgather_ring_busbw_gb_s * p.bandwidth_fraction)
  t_net = (s.k - 1) / s.k * S / _net_bytes_s(hw, p, s.m_min) if s.k > 1 else 0.0
  yield ("ring" if s.k == 1 else "ring+ring"), lat_us, max(t_intra, t_net)


def _all_to_all(S: float, s: _Shape, hw: Hardware, p: Protocol):
  """Each member sends S/n to every other member at once (NCCL: grouped send/recv).
  On a node with c members a GPU sends (c-1)/n of S over NVLink and (n-c)/n of S
  over its own NIC, concurrently; the slowest node sets the time. Latency: one
  pipelined step over each link type (optimistic for very many peers)."""
  bw_nvl = _gb_s(hw.allgather_ring_busbw_gb_s * p.bandwidth_fraction)
  t = 0.0
  for c in set(s.counts):
    t_nvl = (c - 1) / s.n * S / bw_nvl
    t_net = (s.n - c) / s.n * S / _net_bytes_s(hw, p, 1) if s.k > 1 else 0.0
    t = max(t, t_nvl, t_net)
  lat_us = (
    p.base_us + (p.nvlink_hop_us if s.m_max > 1 else 0.0) + (p.net_hop_us if s.k > 1 else 0.0)
  )
  yield "p2p", lat_us, t


def _permute(S: float, s: _Shape, hw: Hardware, p: Protocol):
  """One message of S per device. Inside a node it crosses NVLink at the achievable
  per-GPU rate (the ring bus bandwidth is exactly that rate); if any pair spans
  nodes, the slowest pair goes over one GPU's NIC."""
  if s.k == 1:
    bw = _gb_s(hw.allreduce_ring_busbw_gb_s * p.bandwidth_fraction)
    yield "p2p", p.base_us + p.nvlink_hop_us, S / bw
  else:
    yield "p2p", p.base_us + p.net_hop_us, S / _net_bytes_s(hw, p, 1)

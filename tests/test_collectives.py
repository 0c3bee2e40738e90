"""Collective cost model against published NCCL measurements (docs/sources/hardware.md).

The cost model is Python float arithmetic, the same on any machine. Ranges and rel= bounds
against a published measurement are the model's agreement with it (the source is named
beside each); pytest.approx's default (1e-6 relative) checks identities of the formulas,
up to float rounding.
"""

import dataclasses

import pytest

from hardware.catalog import get, names
from projection.collectives import (
  KINDS,
  bus_bandwidth_gb_s,
  bus_factor,
  collective_cost,
  collective_time_s,
  domain_of,
  normalize_kind,
)

GiB, MiB, KiB = 2**30, 2**20, 2**10
H100, H200, A100 = get("h100"), get("h200"), get("a100")


def nodes(n_gpus, per_node):
  """Node of each member when `n_gpus` fill nodes of `per_node` in order."""
  return [i // per_node for i in range(n_gpus)]


def busbw(kind, size, group, hw):
  return bus_bandwidth_gb_s(kind, size, len(group), collective_time_s(kind, size, group, hw))


def test_h100_8gpu_allreduce_1gib_matches_published_busbw():
  # hardware.md: ~370 GB/s ring, ~480 GB/s with NVLS, on 8 H100.
  bw = busbw("all-reduce", GiB, nodes(8, 8), H100)
  assert 370 <= bw <= 480
  assert collective_cost("all-reduce", GiB, nodes(8, 8), H100).algorithm == "nvls"


def test_ring_only_gpus_use_ring_figures():
  assert 200 <= busbw("all-reduce", GiB, nodes(8, 8), A100) <= 232  # A100 ~232
  no_nvls = dataclasses.replace(H100, allreduce_nvls_busbw_gb_s=None, nvlink_sharp=False)
  assert 340 <= busbw("all-reduce", GiB, nodes(8, 8), no_nvls) <= 370  # ring ~370


def test_h200_busbw_falls_with_message_size_as_measured():
  # stas00, 8xH200: 481 GB/s at 16 GiB, 442 at 256 MiB, 242 at 16 MiB.
  for size, measured in [(16 * GiB, 481), (256 * MiB, 442), (16 * MiB, 242)]:
    assert busbw("all-reduce", size, nodes(8, 8), H200) == pytest.approx(measured, rel=0.1)


def test_small_allreduce_is_latency_bound_tens_of_us():
  # hardware.md: 32 KiB takes ~18 us on 8xH200, ~99 us on 4x8 B200 over EFA.
  one_node = collective_cost("all-reduce", 32 * KiB, nodes(8, 8), H200)
  assert 10e-6 <= one_node.time_s <= 30e-6
  assert one_node.latency_s > 5 * one_node.transfer_s
  assert one_node.protocol == "ll"  # low-latency protocol wins for small messages
  four_nodes = collective_time_s("all-reduce", 32 * KiB, nodes(32, 8), get("b200"))
  assert one_node.time_s < four_nodes <= 120e-6


def test_spanning_nodes_is_slower():
  for hw in (A100, H100, get("b200")):
    for size in (32 * KiB, 16 * MiB, GiB):
      inside = collective_time_s("all-reduce", size, nodes(8, 8), hw)
      assert collective_time_s("all-reduce", size, nodes(16, 8), hw) > inside
      # Same 8 GPUs split 4+4 over two nodes: the NICs become the bottleneck.
      assert collective_time_s("all-reduce", size, nodes(8, 4), hw) > inside
  split = collective_time_s("all-reduce", GiB, nodes(8, 4), H100)
  assert split > 1.3 * collective_time_s("all-reduce", GiB, nodes(8, 8), H100)


def test_multi_node_busbw_at_scale_is_nic_bound():
  # 8 NDR NICs per node: ~370-390 GB/s bus bandwidth across many H100 nodes.
  bw = busbw("all-reduce", 4 * GiB, nodes(256, 8), H100)
  assert 330 <= bw <= 400
  # One member per node (a DP group across nodes): one NIC each, ~47 GB/s.
  assert 35 <= busbw("all-reduce", 4 * GiB, list(range(64)), H100) <= 47


def test_huge_groups_pick_the_tree_for_latency():
  group = nodes(16384, 8)
  small = collective_cost("all-reduce", 32 * KiB, group, H100)
  assert "tree" in small.algorithm
  assert small.time_s < 1e-3  # a 2048-node ring would take milliseconds
  assert collective_time_s("all-reduce", GiB, group, H100) < 10e-3


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("group", [nodes(8, 8), nodes(64, 8), list(range(4)), nodes(72, 72)])
def test_time_grows_with_bytes(kind, group):
  hw = get("gb200") if len(group) == 72 else H100
  sizes = [2**p for p in range(8, 34, 2)]
  times = [collective_time_s(kind, s, group, hw) for s in sizes]
  assert all(a < b for a, b in zip(times, times[1:]))
  assert times[0] > 5e-6  # never cheaper than a call's latency


def test_nvl72_domain_beats_hgx_nodes():
  in_domain, hgx = nodes(64, 72), nodes(64, 8)
  gb200, b200 = get("gb200"), get("b200")
  for kind in ("all-reduce", "all-gather", "reduce-scatter", "all-to-all"):
    one = collective_time_s(kind, GiB, in_domain, gb200)
    eight = collective_time_s(kind, GiB, hgx, b200)
    assert eight > 1.5 * one, kind
  assert collective_time_s("all-to-all", GiB, hgx, b200) > 5 * collective_time_s(
    "all-to-all", GiB, in_domain, gb200
  )


def test_gather_and_scatter_are_symmetric_and_half_an_allreduce():
  group = nodes(8, 8)
  ag = collective_time_s("all-gather", GiB, group, A100)
  rs = collective_time_s("reduce-scatter", GiB, group, A100)
  ar = collective_time_s("all-reduce", GiB, group, A100)
  assert ag == rs
  assert ar == pytest.approx(2 * ag, rel=0.05)  # ring all-reduce = RS + AG


def test_permute_intra_vs_inter_node():
  size = 64 * MiB
  intra = collective_cost("collective-permute", size, [0, 0], H100)
  inter = collective_cost("collective-permute", size, [0, 1], H100)
  assert size / intra.transfer_s / 1e9 == pytest.approx(H100.allreduce_ring_busbw_gb_s)
  assert size / inter.transfer_s / 1e9 == pytest.approx(H100.nic_gb_s_per_gpu)


def test_degenerate_groups_cost_nothing():
  assert collective_time_s("all-reduce", GiB, [3], H100) == 0.0
  assert collective_time_s("all-gather", 0, nodes(8, 8), H100) == 0.0


def test_kinds_and_helpers():
  assert normalize_kind("all_reduce") == "all-reduce"
  assert normalize_kind("all-gather-start") == "all-gather"
  with pytest.raises(ValueError, match="all-to-all"):
    normalize_kind("broadcast")
  assert bus_factor("all-reduce", 8) == pytest.approx(1.75)
  assert bus_factor("reduce-scatter", 8) == pytest.approx(0.875)
  assert bus_factor("collective-permute", 2) == 1.0
  assert [domain_of(i, get("gb200")) for i in (0, 71, 72)] == [0, 0, 1]
  assert [domain_of(i, H100) for i in (7, 8)] == [0, 1]


@pytest.mark.parametrize("name", names())
def test_every_gpu_costs_every_kind(name):
  hw = get(name)
  group = nodes(2 * hw.nvlink_domain_size, hw.nvlink_domain_size)
  for kind in KINDS:
    cost = collective_cost(kind, 256 * MiB, group, hw)
    assert 0 < cost.latency_s < cost.time_s < 1.0


def test_operands_add_latency_only_where_the_hardware_runs_them_one_by_one():
  # NCCL groups a combined collective's operands into one call; XLA:CPU (the host
  # profile) runs a rendezvous per operand, about one latency each.
  group = nodes(8, 8)
  one = collective_cost("all-reduce", 32 * KiB, group, H100)
  assert collective_cost("all-reduce", 32 * KiB, group, H100, operands=12) == one
  serial = dataclasses.replace(H100, operand_latency_fraction=1.0)
  twelve = collective_cost("all-reduce", 32 * KiB, group, serial, operands=12)
  assert twelve.latency_s == pytest.approx(12 * one.latency_s)
  assert twelve.transfer_s == one.transfer_s

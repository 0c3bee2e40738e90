"""Hardware catalog: per-GPU figures for the step-time projection, as data.

Every figure carries its source in the entry's `sources` mapping (field name -> text).
Peak figures are what MFU is quoted against; "achievable" figures are what others
measured and what the cost model is calibrated against. Facts come from the public
sources summarised in docs/sources/hardware.md (abbreviated "hardware.md" in the source
texts: NVIDIA datasheets, stas00/ml-engineering, NVIDIA/nccl-tests issues, NCCL's tuning
model, MLPerf Training system descriptions) unless the source text says otherwise;
figures we derived or estimated say so.

A new GPU is one new `Hardware(...)` entry in `_CATALOG`; no code changes.

The module is long because it is data: six entries of some twenty sourced figures each,
kept beside the two types and the shared constants they are written in.

Units are in the names: *_tflops (1e12 FLOP/s), *_gb_s (1e9 bytes/s), *_tb_s
(1e12 bytes/s), *_gbit_s (1e9 bits/s), *_gib (2**30 bytes), *_us (microseconds).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Mapping

# ---------------------------------------------------------------------------
# Types
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Protocol:
  """Latency and bandwidth of one NCCL protocol (Simple, LL128, LL).

  NCCL chooses, per call, the (algorithm, protocol) pair with the lowest predicted
  time. Simple has full bandwidth but high per-step latency; LL (8-byte lines with
  a 4-byte flag) has the lowest latency at a quarter of the bandwidth; LL128 sits
  between. The cost model does the same minimisation over the entries given here.
  """

  name: str
  base_us: float  # per-call base latency
  nvlink_hop_us: float  # per ring step over NVLink (intra NVLink domain)
  net_hop_us: float  # per ring step over the network (between domains)
  tree_net_hop_us: float  # per tree level over the network (all-reduce tree)
  bandwidth_fraction: float  # of the Simple protocol's achievable bus bandwidth


@dataclass(frozen=True)
class Hardware:
  """One accelerator type and the node/network it sits in. All figures per GPU."""

  name: str
  description: str
  # Topology. gpus_per_node is the physical host (HGX board, or GB200/GB300 compute
  # tray); nvlink_domain_size is how many GPUs share one NVLink fabric. The
  # collective cost model's "node" is the NVLink domain.
  gpus_per_node: int
  nvlink_domain_size: int
  # Matmul throughput, dense (no 2:4 sparsity).
  peak_bf16_tflops: float
  peak_fp8_tflops: float | None
  achievable_bf16_tflops: float
  achievable_fp8_tflops: float | None
  # Memory.
  hbm_gib: float  # usable capacity
  hbm_peak_tb_s: float
  hbm_achievable_fraction: float
  # Scale-up (NVLink).
  nvlink_gb_s: float  # per GPU, each direction (line rate)
  nvlink_sharp: bool  # NVSwitch in-network reduction (NVLS) available
  allreduce_ring_busbw_gb_s: float  # achievable, large message, inside one domain
  allreduce_nvls_busbw_gb_s: float | None  # achievable with NVLS, None if no NVLS
  # Scale-out (NICs), per GPU.
  nics_per_gpu: int
  nic_gbit_s: float  # line rate per NIC
  nic_achievable_gb_s: float  # measured per NIC, each direction
  # Latency model (NCCL tuning model figures) and kernel launch.
  protocols: tuple[Protocol, ...]
  nvls_latency_us: float | None
  kernel_launch_us: float
  # Optional figures.
  tdp_w: float | None = None
  peak_f32_tflops: float | None = None
  achievable_f32_tflops: float | None = None
  # Bus bandwidth of all-gather / reduce-scatter / all-to-all inside a domain when
  # measured separately; None means "same as allreduce_ring_busbw_gb_s".
  allgather_busbw_gb_s: float | None = None
  # Latency each operand of a multi-operand collective adds past the first, as a fraction
  # of the collective's latency: 0 where the library runs them as one call (NCCL groups
  # them); XLA:CPU's in-process collectives run a rendezvous per operand (host.py).
  operand_latency_fraction: float = 0.0
  # Blackwell's block-scaled tensor-core formats (model/block_scaled.py): MXFP8 runs at
  # the FP8 rate, NVFP4 at the FP4 rate; none on Hopper and older.
  block_scaled_formats: tuple[str, ...] = ()
  peak_fp4_tflops: float | None = None
  achievable_fp4_tflops: float | None = None
  sources: Mapping[str, str] = field(default_factory=dict, hash=False, compare=False)

  # -- derived figures ----------------------------------------------------
  @property
  def hbm_bytes(self) -> int:
    return int(self.hbm_gib * 2**30)

  @property
  def hbm_achievable_tb_s(self) -> float:
    return self.hbm_peak_tb_s * self.hbm_achievable_fraction

  @property
  def nic_gb_s_per_gpu(self) -> float:
    """Achievable scale-out bandwidth of one GPU, each direction (all its rails)."""
    return self.nics_per_gpu * self.nic_achievable_gb_s

  @property
  def allgather_ring_busbw_gb_s(self) -> float:
    return self.allgather_busbw_gb_s or self.allreduce_ring_busbw_gb_s

  def peak_tflops(self, dtype: str) -> float | None:
    """Peak dense TFLOP/s for 'bf16', 'fp8', 'fp4' or 'f32' (None if not supported/known)."""
    return getattr(self, f"peak_{_dtype_key(dtype)}_tflops")

  def achievable_tflops(self, dtype: str) -> float | None:
    """Large-GEMM TFLOP/s for 'bf16', 'fp8', 'fp4' or 'f32' (measured; fp4 estimated)."""
    return getattr(self, f"achievable_{_dtype_key(dtype)}_tflops")


def _dtype_key(dtype: str) -> str:
  aliases = {
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp8": "fp8",
    "f8": "fp8",
    "float8_e4m3fn": "fp8",
    "float8_e5m2": "fp8",
    "fp4": "fp4",
    "f4": "fp4",
    "float4_e2m1fn": "fp4",
    "f32": "f32",
    "float32": "f32",
  }
  try:
    return aliases[str(dtype).lower()]
  except KeyError:
    raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(aliases)}") from None


# ---------------------------------------------------------------------------
# Shared figures
# ---------------------------------------------------------------------------

# NCCL's tuning model (NVIDIA/nccl src/graph/tuning.cc, baseLat/hwLat tables, as cited
# in hardware.md): Ring Simple 8.4 us base + 3.4 us per NVLink step + 14 us per network
# step; Ring LL 6.6 / 0.6 / 2.7; Ring LL128 14.0 / 1.9 / 4.0. Tree network levels:
# Simple 28, LL128 8.5, LL 5.0 us. Bandwidth: LL gets 1/4 of Simple's bus bandwidth
# (half of each 8-byte line is a flag, plus polling), LL128 0.92 (120 of 128 bytes are
# payload) - both from the same file's model refinements.
NCCL_PROTOCOLS: tuple[Protocol, ...] = (
  Protocol(
    "simple",
    base_us=8.4,
    nvlink_hop_us=3.4,
    net_hop_us=14.0,
    tree_net_hop_us=28.0,
    bandwidth_fraction=1.0,
  ),
  Protocol(
    "ll128",
    base_us=14.0,
    nvlink_hop_us=1.9,
    net_hop_us=4.0,
    tree_net_hop_us=8.5,
    bandwidth_fraction=0.92,
  ),
  Protocol(
    "ll",
    base_us=6.6,
    nvlink_hop_us=0.6,
    net_hop_us=2.7,
    tree_net_hop_us=5.0,
    bandwidth_fraction=0.25,
  ),
)

# NCCL's table charges NVLS 23 us. Fitting t = L + S/B to stas00's 8xH200 NVLS curve
# (442 GB/s bus bandwidth at 256 MiB, 242 at 16 MiB, hardware.md) gives B ~ 467 GB/s
# and L ~ 58 us: the measured curve rises more slowly than 23 us predicts. We use the
# fit, since the goal is to predict measured time.
NVLS_LATENCY_US = 55.0

# A CUDA kernel launch costs a few microseconds (estimate; not in hardware.md). The
# projection charges it per kernel on the critical path when it is not hidden.
KERNEL_LAUNCH_US = 4.0

# Achievable HBM bandwidth: STREAM-like copy kernels typically reach 85-90% of the
# peak on HBM GPUs. Estimate, not a measurement in hardware.md; 0.88 is its midpoint.
# None of these efficiencies (this, the GEMM rates, NIC_EFFICIENCY, RING_EFFICIENCY,
# KERNEL_LAUNCH_US) is fitted to the MLPerf GPT-3 calibration points: the residual there
# is the program's and not one factor (experiments/mlperf_gpt3_175b.py, PUBLISHED).
HBM_FRACTION = 0.88

# NDR 400 Gb/s NIC: 46-49 GB/s each way measured (hardware.md) -> 47, i.e. 94% of the
# 50 GB/s line rate. HDR and XDR are scaled from it at the same 94% (derived).
NIC_EFFICIENCY = 47.0 / 50.0

# The ring all-reduce reaches 370 of 450 GB/s NVLink line rate on H100 (82%,
# hardware.md). Where no ring figure is published we apply this ratio (derived).
RING_EFFICIENCY = 370.0 / 450.0

_HBM_RESERVE = 84942979072 / 2**30 / 80.0  # H100: 79.1 of 80 GiB usable (see H100)

_S_PEAK = (
  "hardware.md peak table: NVIDIA datasheets, dense = half the sparse values; "
  "Glenn Klockwood's processor pages"
)
_S_GEMM = "hardware.md: stas00/ml-engineering 'Maximum Achievable Matmul FLOPS'"
_S_NVL = (
  "hardware.md: half the marketed bidirectional NVLink total (NVIDIA/nccl-tests "
  "issue 212: '450GB/s is the line rate')"
)
_S_NIC = "hardware.md / MLPerf Training system descriptions (systems/*.json)"
_S_NIC_ACH = "hardware.md: 400 Gb/s NDR measured at 46-49 GB/s each way -> 47"
_S_LAT = "NCCL tuning model (NVIDIA/nccl src/graph/tuning.cc), cited in hardware.md"
_S_NVLS_LAT = "fit to stas00's 8xH200 all-reduce curve in hardware.md (NCCL table: 23 us)"
_S_HBMF = "estimate: STREAM-like copies reach ~85-90% of HBM peak"
_S_LAUNCH = "estimate: CUDA kernel launch is a few microseconds"
_S_FP4_GEMM = (
  "estimate: no measured FP4 GEMM rate in hardware.md; the peak x the FP8 GEMM's "
  "measured share of its peak ({share})"
)
# Blackwell's block-scaled formats (NVIDIA Blackwell architecture; the OCP MX spec).
BLOCK_SCALED = ("mxfp8", "nvfp4")


def _common_sources(**extra: str) -> dict[str, str]:
  """Sources shared by every GPU entry, plus the entry-specific ones."""
  base = {
    "peak_bf16_tflops": _S_PEAK,
    "peak_fp8_tflops": _S_PEAK,
    "peak_fp4_tflops": _S_PEAK,
    "block_scaled_formats": "Blackwell (sm_100, sm_103) tensor cores run MXFP8 and NVFP4 "
    "(hardware.md FP4 column); Hopper has neither",
    "achievable_bf16_tflops": _S_GEMM,
    "achievable_fp8_tflops": _S_GEMM,
    "hbm_peak_tb_s": _S_PEAK,
    "hbm_achievable_fraction": _S_HBMF,
    "nvlink_gb_s": _S_NVL,
    "nics_per_gpu": _S_NIC,
    "nic_gbit_s": _S_NIC,
    "nic_achievable_gb_s": _S_NIC_ACH,
    "protocols": _S_LAT,
    "nvls_latency_us": _S_NVLS_LAT,
    "kernel_launch_us": _S_LAUNCH,
    "operand_latency_fraction": "XLA GPU runs a combined collective's operands as one "
    "grouped NCCL call (ncclGroupStart/End): one latency",
    "tdp_w": _S_PEAK,
    "gpus_per_node": "HGX board: 8 GPUs (hardware.md)",
    "nvlink_domain_size": "hardware.md peak table (NVLink domain)",
    "nvlink_sharp": "NVSwitch 3rd gen and later support NVLS (hardware.md: H100 NVLS "
    "all-reduce figures); A100's NVSwitch has no SHARP",
  }
  base.update(extra)
  return base


_WITH_NVLS = dict(nvlink_sharp=True, nvls_latency_us=NVLS_LATENCY_US)

# ---------------------------------------------------------------------------
# The catalog
# ---------------------------------------------------------------------------

_CATALOG: tuple[Hardware, ...] = (
  Hardware(
    name="a100",
    description="A100 SXM 80GB, HGX 8-GPU, NVLink 3, 1x HDR 200 Gb/s per GPU",
    gpus_per_node=8,
    nvlink_domain_size=8,
    peak_bf16_tflops=312.0,
    peak_fp8_tflops=None,
    achievable_bf16_tflops=271.0,
    achievable_fp8_tflops=None,
    hbm_gib=80.0 * _HBM_RESERVE,
    hbm_peak_tb_s=2.039,
    hbm_achievable_fraction=HBM_FRACTION,
    nvlink_gb_s=300.0,
    nvlink_sharp=False,
    allreduce_ring_busbw_gb_s=232.0,
    allreduce_nvls_busbw_gb_s=None,
    nics_per_gpu=1,
    nic_gbit_s=200.0,
    nic_achievable_gb_s=200.0 / 8 * NIC_EFFICIENCY,
    protocols=NCCL_PROTOCOLS,
    nvls_latency_us=None,
    kernel_launch_us=KERNEL_LAUNCH_US,
    tdp_w=400.0,
    sources=_common_sources(
      hbm_gib="estimate: 80 GB class like H100, same usable share as H100 (79.1 GiB)",
      allreduce_ring_busbw_gb_s="hardware.md: ~232 GB/s inside one 8-GPU node",
      nic_achievable_gb_s="derived: HDR 25 GB/s line x the 94% NDR efficiency",
      nvls_latency_us="no NVLS on A100",
    ),
  ),
  Hardware(
    name="h100",
    description="H100 SXM 80GB, HGX 8-GPU, NVLink 4, 1x NDR 400 Gb/s per GPU",
    gpus_per_node=8,
    nvlink_domain_size=8,
    peak_bf16_tflops=989.0,
    peak_fp8_tflops=1979.0,
    achievable_bf16_tflops=794.0,
    achievable_fp8_tflops=1403.0,
    hbm_gib=84942979072 / 2**30,
    hbm_peak_tb_s=3.35,
    hbm_achievable_fraction=HBM_FRACTION,
    nvlink_gb_s=450.0,
    allreduce_ring_busbw_gb_s=370.0,
    allreduce_nvls_busbw_gb_s=480.0,
    nics_per_gpu=1,
    nic_gbit_s=400.0,
    nic_achievable_gb_s=47.0,
    protocols=NCCL_PROTOCOLS,
    kernel_launch_us=KERNEL_LAUNCH_US,
    tdp_w=700.0,
    **_WITH_NVLS,
    sources=_common_sources(
      hbm_gib="XLA-reported device_memory_size 84942979072 B (hardware/targets/h100.txtpb)",
      allreduce_ring_busbw_gb_s="hardware.md: ~370 GB/s ring, 8 GPUs (nccl-tests issues)",
      allreduce_nvls_busbw_gb_s="hardware.md: ~480 GB/s with NVLS, 8 GPUs",
    ),
  ),
  Hardware(
    name="h200",
    description="H200 SXM 141GB, HGX 8-GPU, NVLink 4, 1x NDR 400 Gb/s per GPU",
    gpus_per_node=8,
    nvlink_domain_size=8,
    peak_bf16_tflops=989.0,
    peak_fp8_tflops=1979.0,
    achievable_bf16_tflops=794.0,
    achievable_fp8_tflops=1453.0,
    hbm_gib=141.0 * _HBM_RESERVE,
    hbm_peak_tb_s=4.8,
    hbm_achievable_fraction=HBM_FRACTION,
    nvlink_gb_s=450.0,
    allreduce_ring_busbw_gb_s=370.0,
    allreduce_nvls_busbw_gb_s=478.0,
    nics_per_gpu=1,
    nic_gbit_s=400.0,
    nic_achievable_gb_s=47.0,
    protocols=NCCL_PROTOCOLS,
    kernel_launch_us=KERNEL_LAUNCH_US,
    tdp_w=700.0,
    **_WITH_NVLS,
    sources=_common_sources(
      achievable_bf16_tflops="hardware.md: stas00 - same as H100",
      hbm_gib="estimate: 141 GB marketed (~GiB) x H100's usable share (0.989)",
      allreduce_ring_busbw_gb_s="assumed same as H100: same NVLink 4 / NVSwitch fabric",
      allreduce_nvls_busbw_gb_s="hardware.md: 475-481 GB/s, 8xH200 (stas00)",
    ),
  ),
  Hardware(
    name="b200",
    description="B200 HGX 8-GPU, NVLink 5, 1x NDR 400 Gb/s per GPU",
    gpus_per_node=8,
    nvlink_domain_size=8,
    peak_bf16_tflops=2250.0,
    peak_fp8_tflops=4500.0,
    achievable_bf16_tflops=1745.0,
    achievable_fp8_tflops=3433.0,
    hbm_gib=180.0 * _HBM_RESERVE,
    hbm_peak_tb_s=7.7,
    hbm_achievable_fraction=HBM_FRACTION,
    nvlink_gb_s=900.0,
    allreduce_ring_busbw_gb_s=900.0 * RING_EFFICIENCY,
    allreduce_nvls_busbw_gb_s=839.0,
    nics_per_gpu=1,
    nic_gbit_s=400.0,
    nic_achievable_gb_s=47.0,
    protocols=NCCL_PROTOCOLS,
    kernel_launch_us=KERNEL_LAUNCH_US,
    block_scaled_formats=BLOCK_SCALED,
    peak_fp4_tflops=9000.0,
    achievable_fp4_tflops=6866.0,
    tdp_w=1000.0,
    **_WITH_NVLS,
    sources=_common_sources(
      achievable_fp4_tflops=_S_FP4_GEMM.format(share="3433 / 4500"),
      hbm_gib="estimate: 180 GB marketed (~GiB) x H100's usable share (0.989)",
      allreduce_ring_busbw_gb_s="derived: 900 GB/s x H100's ring efficiency (370/450)",
      allreduce_nvls_busbw_gb_s="hardware.md: ~839 GB/s, 8xB200 (best measured; "
      "NCCL picks NVLS when it is faster)",
    ),
  ),
  Hardware(
    name="gb200",
    description="GB200 NVL72 (72-GPU NVLink 5 domain), 1x NDR 400 Gb/s per GPU",
    gpus_per_node=4,
    nvlink_domain_size=72,
    peak_bf16_tflops=2500.0,
    peak_fp8_tflops=5000.0,
    achievable_bf16_tflops=1822.0,
    achievable_fp8_tflops=3616.0,
    hbm_gib=189471 / 1024,
    hbm_peak_tb_s=8.0,
    hbm_achievable_fraction=HBM_FRACTION,
    nvlink_gb_s=900.0,
    allreduce_ring_busbw_gb_s=900.0 * RING_EFFICIENCY,
    allreduce_nvls_busbw_gb_s=811.0,
    nics_per_gpu=1,
    nic_gbit_s=400.0,
    nic_achievable_gb_s=47.0,
    protocols=NCCL_PROTOCOLS,
    kernel_launch_us=KERNEL_LAUNCH_US,
    block_scaled_formats=BLOCK_SCALED,
    peak_fp4_tflops=10000.0,
    achievable_fp4_tflops=7232.0,
    tdp_w=1200.0,
    **_WITH_NVLS,
    sources=_common_sources(
      achievable_fp4_tflops=_S_FP4_GEMM.format(share="3616 / 5000"),
      gpus_per_node="compute tray: 4 GPUs (MLPerf GB200 system descriptions; NVL72 = 18 trays)",
      hbm_gib="MLPerf Training system description: 189,471 MiB usable",
      allreduce_ring_busbw_gb_s="derived: 900 GB/s x H100's ring efficiency (370/450)",
      allreduce_nvls_busbw_gb_s="hardware.md: ~811 GB/s over multi-node NVLink",
    ),
  ),
  Hardware(
    name="gb300",
    description="GB300 NVL72 (Blackwell Ultra), 1x ConnectX-8 XDR 800 Gb/s per GPU",
    gpus_per_node=4,
    nvlink_domain_size=72,
    peak_bf16_tflops=2500.0,
    peak_fp8_tflops=5000.0,
    achievable_bf16_tflops=1769.0,
    achievable_fp8_tflops=3353.0,
    hbm_gib=284208 / 1024,
    hbm_peak_tb_s=8.0,
    hbm_achievable_fraction=HBM_FRACTION,
    nvlink_gb_s=900.0,
    allreduce_ring_busbw_gb_s=900.0 * RING_EFFICIENCY,
    allreduce_nvls_busbw_gb_s=811.0,
    nics_per_gpu=1,
    nic_gbit_s=800.0,
    nic_achievable_gb_s=800.0 / 8 * NIC_EFFICIENCY,
    protocols=NCCL_PROTOCOLS,
    kernel_launch_us=KERNEL_LAUNCH_US,
    block_scaled_formats=BLOCK_SCALED,
    peak_fp4_tflops=15000.0,
    achievable_fp4_tflops=10059.0,
    tdp_w=1400.0,
    **_WITH_NVLS,
    sources=_common_sources(
      achievable_fp4_tflops=_S_FP4_GEMM.format(share="3353 / 5000"),
      gpus_per_node="compute tray: 4 GPUs (as GB200 NVL72)",
      achievable_bf16_tflops="hardware.md: stas00's B300 measurement (same GPU die)",
      achievable_fp8_tflops="hardware.md: stas00's B300 measurement (same GPU die)",
      hbm_gib="MLPerf Training system description: 284,208 MiB usable",
      allreduce_ring_busbw_gb_s="assumed as GB200: same NVLink 5 switch fabric",
      allreduce_nvls_busbw_gb_s="assumed as GB200 (811 GB/s measured there)",
      nic_achievable_gb_s="derived: XDR 100 GB/s line x the 94% NDR efficiency",
    ),
  ),
)

_BY_NAME: dict[str, Hardware] = {hw.name: hw for hw in _CATALOG}


def names() -> list[str]:
  """Names of the GPU entries, in catalog order (oldest first): the one list of them.
  This machine's measured profile ('host') is not an entry: measure/host_calibration.py
  makes it."""
  return [hw.name for hw in _CATALOG]


def get(name: str) -> Hardware:
  """The entry called `name` (case-insensitive)."""
  key = name.strip().lower()
  if key not in _BY_NAME:
    raise ValueError(f"unknown hardware {name!r}; known: {', '.join(names())}")
  return _BY_NAME[key]


def missing_sources(hw: Hardware) -> list[str]:
  """Figures of `hw` that are set (not None, not empty) but have no source text (should be
  empty)."""
  skip = {"name", "description", "sources"}
  return [
    f.name
    for f in fields(hw)
    if f.name not in skip and getattr(hw, f.name) not in (None, ()) and not hw.sources.get(f.name)
  ]

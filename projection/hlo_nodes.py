"""The program projection/hlo.py reads from optimized HLO text: its nodes (compute ops,
collectives, async waits, loops) in schedule order. The conventions of their FLOPs and
bytes are projection/hlo.py's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from projection.hlo_text import Groups


@dataclass(frozen=True)
class Compute:
  """One kernel-level instruction (a fusion, a dot, a custom-call, a copy, ...)."""

  name: str
  opcode: str
  flops: float  # all FLOPs, dot FLOPs included
  dot_flops: float  # FLOPs of dot/convolution/gemm only (tensor-core work)
  bytes_read: int
  bytes_written: int
  dtype: str  # element type of the (first) output
  kind: str = ""  # fusion kind (kLoop, __triton_gemm, ...) or custom-call target
  # Element type of the matmul inputs, "" if none: a bf16 gemm may output f32 (split-K).
  dot_dtype: str = ""
  # Its metadata op_name: the jax.named_scope / primitive path it came from, which says
  # what program code a costly op belongs to (diagnostics only; the cost model ignores it).
  op_name: str = ""
  # Its name when XLA scheduled it (metadata scheduling_name, else its name; later passes
  # may rename it): the name a latency profile for XLA's scheduler gives its cost under.
  scheduling_name: str = ""


@dataclass(frozen=True)
class Collective:
  name: str
  kind: str  # "all-reduce", "all-gather", ... (no -start suffix)
  bytes: int  # see module docstring for the convention per kind
  dtype: str
  groups: Groups = ()  # partition ids; empty for permutes
  pairs: tuple[tuple[int, int], ...] = ()  # collective-permute source->target
  is_async: bool = False  # a start/done pair
  done: str | None = None  # name of the matching -done
  overlapped: tuple[str, ...] = ()  # nodes scheduled between start and done
  xla_sync: bool = False  # XLA GPU marked the start is_sync: it runs without overlap
  # Arrays it moves: XLA combines small collectives into one with many operands, which
  # NCCL runs as one grouped call but XLA:CPU as one rendezvous per operand.
  operands: int = 1
  scheduling_name: str = ""  # as Compute's

  @property
  def group_size(self) -> int:
    """Devices per replica group (1 for a collective-permute)."""
    return len(self.groups[0]) if self.groups else 1


@dataclass(frozen=True)
class AsyncDone:
  """Where an async collective is waited for, in schedule order."""

  name: str
  start: str


@dataclass(frozen=True)
class Loop:
  name: str
  trip_count: int
  body: tuple["Node", ...]
  trip_count_source: str  # "backend_config", "condition" or "unknown" (then 1)
  # The while op's metadata op_name: its jax.named_scope path, e.g.
  # "jit(train_step)/grad_accumulation/while", which names what the loop is.
  op_name: str = ""


Node = Union[Compute, Collective, AsyncDone, Loop]


@dataclass(frozen=True)
class Program:
  name: str
  num_partitions: int
  entry: tuple[Node, ...]

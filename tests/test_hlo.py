"""projection/hlo.py on programs compiled for the 8 host CPU devices (tests/conftest.py)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from projection import hlo, hlo_text


def _compile(f, *args, **jit_kwargs):
  return jax.jit(f, **jit_kwargs).lower(*args).compile()


def _mesh(shape, names, devices=None):
  devices = np.array(jax.devices()[:8] if devices is None else devices).reshape(shape)
  return Mesh(devices, names, axis_types=(AxisType.Auto,) * len(shape))


def _collectives(program, kind):
  return [c for c, _ in hlo.collectives(program) if c.kind == kind]


def test_matmul_dot_flops_are_exact():
  m, n, k = 96, 40, 24
  compiled = _compile(lambda a, b: a @ b, jnp.ones((m, k)), jnp.ones((k, n)))
  program = hlo.analyze(compiled.as_text())
  assert hlo.dot_flops(program) == 2 * m * n * k
  assert hlo.total_flops(program) == compiled.cost_analysis()["flops"] == 2 * m * n * k
  (dot,) = [n for n in program.entry if isinstance(n, hlo.Compute)]
  assert dot.dot_dtype == "f32"


def test_batched_dot_counts_batch_dims():
  compiled = _compile(
    lambda a, b: jnp.einsum("bmk,bkn->bmn", a, b), jnp.ones((3, 8, 5)), jnp.ones((3, 5, 7))
  )
  assert hlo.dot_flops(hlo.analyze(compiled.as_text())) == 2 * 3 * 8 * 7 * 5


def _scan(x, ws):
  return jax.lax.scan(lambda c, w: (c @ w, None), x, ws)[0]


def test_scan_counts_every_trip_unlike_xla_cost_analysis():
  x, ws = jnp.ones((8, 64)), jnp.ones((7, 64, 64))
  one = 2 * 8 * 64 * 64
  compiled = _compile(_scan, x, ws)
  program = hlo.analyze(compiled.as_text())
  loops = [n for n in program.entry if isinstance(n, hlo.Loop)]
  assert [(loop.trip_count, loop.trip_count_source) for loop in loops] == [(7, "backend_config")]
  assert hlo.dot_flops(program) == 7 * one
  # XLA's own analysis counts the loop body once.
  assert compiled.cost_analysis()["flops"] < 2 * one
  # The per-layer weight is a dynamic-slice of the stacked array: a step reads one slice,
  # not all seven.
  body_reads = [n.bytes_read for n in loops[0].body if isinstance(n, hlo.Compute)]
  assert max(body_reads) <= 64 * 64 * 4 + 8 * 64 * 4 + 64
  assert sum(body_reads) < ws.nbytes / 2


def test_trip_count_falls_back_to_the_condition():
  text = _compile(_scan, jnp.ones((8, 16)), jnp.ones((7, 16, 16))).as_text()
  text = re.sub(r'"known_trip_count":\{"n":"\d+"\},?', "", text)
  loops = [n for n in hlo.analyze(text).entry if isinstance(n, hlo.Loop)]
  assert [(loop.trip_count, loop.trip_count_source) for loop in loops] == [(7, "condition")]


HANDWRITTEN = """HloModule loop, is_scheduled=true, num_partitions=1

%body (p: (s32[], f32[4,4])) -> (s32[], f32[4,4]) {
  %p = (s32[], f32[4,4]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[4,4]{1,0} get-tuple-element(%p), index=1
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  %y = f32[4,4]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  ROOT %t = (s32[], f32[4,4]{1,0}) tuple(%next, %y)
}

%cond (p.1: (s32[], f32[4,4])) -> pred[] {
  %p.1 = (s32[], f32[4,4]{1,0}) parameter(0)
  %i.1 = s32[] get-tuple-element(%p.1), index=0
  %n = s32[] constant(9)
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

ENTRY %main (x.2: f32[4,4]) -> f32[4,4] {
  %x.2 = f32[4,4]{1,0} parameter(0)
  %start = s32[] constant(2)
  %init = (s32[], f32[4,4]{1,0}) tuple(%start, %x.2)
  %w = (s32[], f32[4,4]{1,0}) while(%init), condition=%cond, body=%body
  ROOT %out = f32[4,4]{1,0} get-tuple-element(%w), index=1
}
"""


def test_trip_count_from_a_handwritten_condition_with_nonzero_start():
  program = hlo.analyze(HANDWRITTEN)
  (loop,) = program.entry
  assert (loop.trip_count, loop.trip_count_source) == (7, "condition")
  assert hlo.dot_flops(program) == 7 * 2 * 4 * 4 * 4
  assert hlo.total_flops(program) == 7 * (2 * 4 * 4 * 4 + 1)  # + the counter's add


def test_nested_loops_multiply():
  def f(x, w):
    inner = lambda c, _: (jax.lax.fori_loop(0, 3, lambda i, y: y @ w, c), None)
    return jax.lax.scan(inner, x, None, length=4)[0]

  program = hlo.analyze(_compile(f, jnp.ones((16, 16)), jnp.ones((16, 16))).as_text())
  assert hlo.dot_flops(program) == 12 * 2 * 16**3


def test_conditional_takes_the_costlier_branch():
  f = lambda p, x, w: jax.lax.cond(p, lambda: x @ w, lambda: x + 1.0)
  program = hlo.analyze(_compile(f, True, jnp.ones((32, 32)), jnp.ones((32, 32))).as_text())
  assert hlo.dot_flops(program) == 2 * 32**3


def test_elementwise_and_transcendental_count_one_flop_per_element():
  program = hlo.analyze(_compile(lambda x: jnp.tanh(x) * 2.0, jnp.ones((10, 30))).as_text())
  assert hlo.total_flops(program) == 2 * 300
  assert hlo.dot_flops(program) == 0


@pytest.mark.parametrize("devices", ["in order", "permuted"])
def test_sharded_sum_all_reduce_groups(devices):
  # Groups hold partition ids, i.e. positions in the mesh, whatever devices sit there.
  order = list(range(8)) if devices == "in order" else [3, 1, 0, 2, 7, 5, 6, 4]
  mesh = _mesh((2, 4), ("x", "y"), [jax.devices()[i] for i in order])
  x = jax.ShapeDtypeStruct((16, 32), jnp.float32, sharding=NamedSharding(mesh, P("x", "y")))
  over_y = hlo.analyze(_compile(lambda a: a.sum(axis=1), x).as_text())
  over_x = hlo.analyze(_compile(lambda a: a.sum(axis=0), x).as_text())
  (ar,) = _collectives(over_y, "all-reduce")
  assert set(ar.groups) == {(0, 1, 2, 3), (4, 5, 6, 7)}
  assert ar.bytes == 8 * 4 and ar.dtype == "f32" and not ar.is_async
  (ar,) = _collectives(over_x, "all-reduce")
  assert set(ar.groups) == {(0, 4), (1, 5), (2, 6), (3, 7)}
  assert ar.bytes == 8 * 4


def test_shard_map_collectives_kinds_bytes_and_groups():
  mesh = _mesh((2, 2, 2), ("x", "y", "z"))

  def body(a):
    return (
      jax.lax.psum(a, ("x", "z")).sum()
      + jax.lax.all_gather(a, "z", tiled=True).sum()
      + jax.lax.psum_scatter(a, "x", tiled=True).sum()
      + jax.lax.ppermute(a, "y", [(0, 1), (1, 0)]).sum()
    )

  f = jax.shard_map(body, mesh=mesh, in_specs=P(("x", "y", "z")), out_specs=P(), check_vma=False)
  program = hlo.analyze(_compile(f, jax.ShapeDtypeStruct((64, 16), jnp.float32)).as_text())
  shard = 8 * 16 * 4  # each device holds 8 of the 64 rows
  positions = np.arange(8).reshape(2, 2, 2)
  (ar,) = _collectives(program, "all-reduce")
  assert set(ar.groups) == {tuple(positions[:, y, :].ravel()) for y in range(2)}
  assert ar.bytes == shard
  (ag,) = _collectives(program, "all-gather")
  assert set(ag.groups) == {tuple(positions[x, y, :]) for x in range(2) for y in range(2)}
  assert ag.bytes == 2 * shard  # output bytes per device
  (rs,) = _collectives(program, "reduce-scatter")
  assert set(rs.groups) == {tuple(positions[:, y, z]) for y in range(2) for z in range(2)}
  assert rs.bytes == shard  # input bytes
  (cp,) = _collectives(program, "collective-permute")
  expected = {
    (int(positions[x, s, z]), int(positions[x, 1 - s, z]))
    for x in range(2)
    for z in range(2)
    for s in range(2)
  }
  assert set(cp.pairs) == expected and cp.bytes == shard and not cp.groups


def test_a_combined_all_reduce_counts_its_operands():
  # XLA combines independent all-reduces into one of several operands (a step's
  # gradients); its bytes are all of theirs.
  mesh = _mesh((8,), ("x",))
  f = jax.shard_map(
    lambda a, b, c: jax.lax.psum((a, b, c), "x"),
    mesh=mesh,
    in_specs=P("x"),
    out_specs=P("x"),
    check_vma=False,
  )
  x = jax.ShapeDtypeStruct((64,), jnp.float32)
  (ar,) = _collectives(hlo.analyze(_compile(f, x, x, x).as_text()), "all-reduce")
  assert ar.operands == 3 and ar.bytes == 3 * 8 * 4


@pytest.mark.parametrize(
  "text, groups",
  [
    ("{{0,1},{2,3}}", ((0, 1), (2, 3))),
    ("{}", ((0, 1, 2, 3),)),
    ("[4,2]<=[8]", ((0, 1), (2, 3), (4, 5), (6, 7))),
    ("[2,4]<=[4,2]T(1,0)", ((0, 2, 4, 6), (1, 3, 5, 7))),
    ("[4,2]<=[2,2,2]T(0,2,1)", ((0, 2), (1, 3), (4, 6), (5, 7))),
    ("[1,8]<=[8]", ((0, 1, 2, 3, 4, 5, 6, 7),)),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_1'}", ((0, 1, 2, 3), (4, 5, 6, 7))),
    ("mesh['axis_0'=2,'axis_1'=4] {'axis_0'}", ((0, 4), (1, 5), (2, 6), (3, 7))),
    # device_ids iota [2,4]T(1,0) lists 0,4,1,5,2,6,3,7 in mesh order.
    (
      "mesh['axis_0'=1,'axis_1'=1,'axis_2'=4,'axis_3'=2], device_ids=([2,4]T(1,0)) {'axis_2'}",
      ((0, 1, 2, 3), (4, 5, 6, 7)),
    ),
    ("mesh['a'=2,'b'=2,'c'=2] {'c','a'}", ((0, 4, 1, 5), (2, 6, 3, 7))),
    # Sub-axis 'a':(2)2 is the middle factor of a = 2 x 2 x 2.
    ("mesh['a'=8] {'a':(2)2}", ((0, 2), (1, 3), (4, 6), (5, 7))),
    ("mesh['a'=4], device_ids=(3,1,0,2) {'a'}", ((3, 1, 0, 2),)),
  ],
)
def test_parse_replica_groups(text, groups):
  assert hlo_text.parse_replica_groups(text, num_partitions=4) == groups


def test_async_start_done_pair_and_overlap_from_text():
  text = """HloModule m, is_scheduled=true, num_partitions=4

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%rs (x: f32[8]) -> f32[2] {
  %x = f32[8]{0} parameter(0)
  ROOT %r = f32[2]{0} reduce-scatter(%x), replica_groups=[1,4]<=[4], dimensions={0}, to_apply=%add
}

ENTRY %main (p: f32[8], q: f32[8]) -> (f32[8], f32[2]) {
  %p = f32[8]{0} parameter(0)
  %q = f32[8]{0} parameter(1)
  %ars = f32[8]{0} all-reduce-start(%p), channel_id=1, replica_groups={{0,1},{2,3}}, to_apply=%add
  %e = f32[8]{0} exponential(%q)
  %ard = f32[8]{0} all-reduce-done(%ars)
  %st = ((f32[8]{0}), f32[2]{0}) async-start(%e), calls=%rs
  %dn = f32[2]{0} async-done(%st)
  ROOT %t = (f32[8]{0}, f32[2]{0}) tuple(%ard, %dn)
}
"""
  nodes = hlo.analyze(text).entry
  assert [type(n).__name__ for n in nodes] == [
    "Collective",
    "Compute",
    "AsyncDone",
    "Collective",
    "AsyncDone",
  ]
  ar, exp, _, rs, _ = nodes
  assert (ar.kind, ar.is_async, ar.done, ar.overlapped) == ("all-reduce", True, "ard", ("e",))
  assert ar.groups == ((0, 1), (2, 3)) and ar.bytes == 32
  assert exp.flops == 8 and exp.bytes_read == 32 and exp.bytes_written == 32
  assert (rs.kind, rs.is_async, rs.done, rs.bytes) == ("reduce-scatter", True, "dn", 32)
  assert rs.groups == ((0, 1, 2, 3),)


def test_cublas_gemm_custom_call_flops_from_backend_config():
  # The form XLA GPU emits after autotuning picks cuBLAS (not seen deviceless, where Triton
  # gemm fusions are used): result plus workspace, dimension numbers in backend_config.
  text = """HloModule m, is_scheduled=true

ENTRY %main (a: bf16[4,64,32], b: bf16[4,32,16]) -> bf16[4,64,16] {
  %a = bf16[4,64,32]{2,1,0} parameter(0)
  %b = bf16[4,32,16]{2,1,0} parameter(1)
  %g = (bf16[4,64,16]{2,1,0}, s8[4194304]{0}) custom-call(%a, %b), custom_call_target="__cublas$gemm", backend_config={"gemm_backend_config":{"alpha_real":1,"dot_dimension_numbers":{"lhs_contracting_dimensions":["2"],"rhs_contracting_dimensions":["1"],"lhs_batch_dimensions":["0"],"rhs_batch_dimensions":["0"]},"epilogue":"DEFAULT"}}
  ROOT %r = bf16[4,64,16]{2,1,0} get-tuple-element(%g), index=0
}
"""
  (gemm,) = hlo.analyze(text).entry
  assert gemm.kind == "__cublas$gemm" and gemm.dtype == gemm.dot_dtype == "bf16"
  assert gemm.dot_flops == gemm.flops == 2 * 4 * 64 * 16 * 32
  assert gemm.bytes_read == (4 * 64 * 32 + 4 * 32 * 16) * 2

"""Context parallelism: each sequence split over the `context` mesh axis.

Every activation's sequence axis is split over `context` (rules.py `length`, and
`act_seq` context-major with sequence parallelism), so each rank runs the matmuls, norms
and MLP on its own tokens only. Attention is the one place a token needs others: its
keys and values come from every earlier position.

Causal load balance (Megatron-Core / Transformer Engine): the sequence is cut into
2 CP chunks and rank r holds chunks r and 2 CP - 1 - r, so every rank has as many
early (cheap) as late (expensive) queries. The program's token order is that
permutation (`order`): the batch arrives whole on every context rank (int32 tokens,
sharding.batch_sharding) and `permuted` reorders inputs and targets before anything is
split, with no collective; the loss is a mean over tokens, indifferent to their order.
Rotary and learned positions use each token's true position (`positions`).

The K/V exchange is one all-gather over `context` per layer (`attention`), its
transpose a reduce-scatter of dK/dV, rather than a ring of CP - 1 collective-permutes
with an online-softmax merge per step. With grouped-query attention the K/V are small
(2 G K values a token, Llama 3.1 405B: 2 x 8 x 128 = 2,048 against d_model 16,384), so the
gather moves little; it is one collective that XLA can schedule as soon as K/V exist,
and autodiff's transpose is the backward. The cost is overlap: the gather's latency is
exposed unless the scheduler hides it behind the Q projection, where a ring hides each
step behind the previous chunk's attention.

After the gather each of a rank's two query chunks runs one masked attention, the mask
comparing true positions, so each query's whole softmax is one kernel call (cuDNN flash
attention or XLA's): the early chunk (r < CP) against the K/V of chunks 0 .. CP - 1
(the first half of every rank's slab), the late chunk against all of them. A masked
cuDNN kernel computes its whole score rectangle, so a rank's attention costs 3 CP c^2
score entries (c = T / 2 CP) against the 2 CP c^2 a causal ring computes: 1.5x the
attention work, a few per cent of a Llama step (docs/context.md).

The train step maps each rank's slab apart (parallelism/gradients.py: jax.vmap over
`context`, axis name SLAB), so weight gradients build up per rank and are reduced once a
step; inside that map (`slabbed`) the model sees one slab of T / CP tokens, already in
order, and takes its positions from the slab's index.
"""

from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from parallelism import rules

CONTEXT = "context"
# The name of the jax.vmap over the context ranks' slabs (parallelism/gradients.py).
SLAB = "context_slab"


def ranks() -> int:
  """Context-parallel ranks of the current mesh (1 outside a mesh or without the axis)."""
  return rules.ranks(CONTEXT)


def order(seq_len: int, context_ranks: int) -> np.ndarray:
  """The true positions in the program's token order [seq_len]: rank r's block is chunk r
  then chunk 2 CP - 1 - r of 2 CP equal chunks (0 .. seq_len - 1 with one rank)."""
  if context_ranks == 1:
    return np.arange(seq_len)
  chunks = np.arange(seq_len).reshape(2 * context_ranks, -1)
  return np.concatenate(
    [np.concatenate([chunks[r], chunks[2 * context_ranks - 1 - r]]) for r in range(context_ranks)]
  )


def slabbed() -> bool:
  """Whether the code being traced runs on one context rank's slab of each sequence:
  jax.vmap over `context` (axis name SLAB; parallelism/gradients.py), rather than on the
  whole sequence split by the partitioner."""
  return CONTEXT in rules.vmapped_axes()


def slabs(tokens: jax.Array, context_ranks: int) -> jax.Array:
  """tokens [..., T] -> [..., CP, T / CP]: rank r's slab, chunks r and 2 CP - 1 - r, at r."""
  ordered = tokens if context_ranks == 1 else tokens[..., order(tokens.shape[-1], context_ranks)]
  return ordered.reshape(*tokens.shape[:-1], context_ranks, -1)


def _true_position(index: jax.Array, c: int, context_ranks: int) -> jax.Array:
  """The true positions (`order`) of the program's tokens `index`, 2c a rank."""
  rank, offset = index // (2 * c), index % (2 * c)
  return jnp.where(offset < c, rank * c + offset, (2 * context_ranks - 2 - rank) * c + offset)


def positions(seq_len: int) -> np.ndarray | jax.Array:
  """True positions of the program's tokens [seq_len] on the current mesh; on a slab
  (`slabbed`, seq_len its length) those of this rank's, from iota and the rank index (no
  array constant: the layers' remat recomputes them, see `attention`)."""
  if not slabbed():
    return order(seq_len, ranks())
  rank = jax.lax.axis_index(SLAB)
  return _true_position(rank * seq_len + jax.lax.iota(jnp.int32, seq_len), seq_len // 2, ranks())


def permuted(tokens: jax.Array) -> jax.Array:
  """tokens [..., T] (inputs or targets; the pipelined losses' carry leading micro-batch
  axes) in the program's token order; unchanged with one context rank, and on a slab,
  which `slabs` cut from the ordered tokens."""
  context_ranks = ranks()
  if context_ranks == 1 or slabbed():
    return tokens
  return tokens[..., order(tokens.shape[-1], context_ranks)]


def shifted(tokens: jax.Array, k: int) -> tuple[jax.Array, jax.Array, int]:
  """tokens [..., T] in the program's token order -> (at each place the token k true
  positions later [..., T], wrapping round past the end as a roll does; whether there is
  one [T] bool; how many places of the whole sequence have one: its true length less k).
  Multi-token prediction's
  shifted targets (model/gpt.py, train/step.py). One rank: a roll. Split over the
  context ranks, a token k positions later may sit on another rank: on a slab the
  sequence's tokens are all-gathered over the slabs (int32, 4 bytes a token), put back
  in true order and read at this slab's true positions plus k."""
  context_ranks, T = ranks(), tokens.shape[-1]
  if context_ranks == 1:
    return jnp.roll(tokens, -k, axis=-1), jnp.arange(T) < T - k, T - k
  if slabbed():
    slab = jax.lax.all_gather(tokens, SLAB)  # [CP, ..., t]
    program_order = jnp.moveaxis(slab, 0, -2).reshape(*tokens.shape[:-1], -1)
    length = program_order.shape[-1]
    here = positions(T)
  else:
    program_order, length, here = tokens, T, order(T, context_ranks)
  true_order = program_order[..., np.argsort(order(length, context_ranks))]
  later = jnp.asarray(here) + k
  return true_order[..., later % length], later < length, length - k


def attention(
  q: jax.Array,
  k: jax.Array,
  v: jax.Array,
  attend: Callable[[jax.Array, jax.Array, jax.Array, jax.Array], jax.Array],
  q_axes: Sequence[str | None],
  kv_axes: Sequence[str | None],
) -> jax.Array:
  """Causal attention over the context ranks. q [B, T, H, K], k, v [B, T, G, K], each split
  along T over `context` in the program's token order -> [B, T, H, K], split likewise;
  q_axes and kv_axes are their logical axes (rules.py).

  attend(q, k, v, mask) is the local attention, mask [Tq, Tk] bool (True: attend). Each
  rank all-gathers K/V and masks by true positions (module docstring). The shard_map is
  manual over every mesh axis: cuDNN attention's partitioning rule (jax 0.10.2) fails
  inside one manual over some axes only, and in a fully manual region there is nothing
  to partition. Batch and heads stay split as they are; where K/V heads are replicated
  over `tensor` (fewer than its ranks) each rank takes the one its query heads share.
  """
  mesh = jax.sharding.get_abstract_mesh()
  context_ranks = mesh.shape[CONTEXT]
  q_spec, kv_spec = (
    rules.spec(rules.resolve(axes, x.shape, mesh.shape)) for axes, x in ((q_axes, q), (kv_axes, k))
  )
  H, G = q.shape[2], k.shape[2]

  def gathered(x):  # its transpose a reduce-scatter: across as rules.on_wire says
    return jax.lax.all_gather(rules.on_wire(x), CONTEXT, axis=1, tiled=True).astype(x.dtype)

  def own_kv_head(x, local_heads):
    """x [b, t, G, K], every K/V head -> [b, t, 1, K], the one this rank's `local_heads`
    query heads (all in one group, as G < tensor ranks) use."""
    first_head = jax.lax.axis_index(q_spec[2]) * local_heads
    return jax.lax.dynamic_slice_in_dim(x, first_head // (H // G), 1, axis=2)

  def local(q, k, v):
    # q [b, 2c, H, K]: chunk r then chunk 2 CP - 1 - r; gathered k, v [b, T, G, K] in the
    # program's order, whose first c tokens of each rank's 2c are chunks 0 .. CP - 1.
    if q_spec[2] is not None and kv_spec[2] is None and G > 1:
      k, v = own_kv_head(k, q.shape[2]), own_kv_head(v, q.shape[2])
    k, v = gathered(k), gathered(v)
    b, t, g = k.shape[:3]
    c = q.shape[1] // 2

    def early(x):  # [b, T, G, K] -> [b, CP c, G, K]: chunks 0 .. CP - 1 (K: V for values)
      return x.reshape(b, t // (2 * c), 2, c, g, -1)[:, :, 0].reshape(b, -1, g, x.shape[-1])

    # The masks are built from iota and the rank index alone, no input or array constant:
    # the layers' remat then recomputes them in the backward pass rather than keeping them
    # as residuals, which the 1F1B pipeline would store per stage (one_f_one_b.py slots)
    # and so batch over `pipeline`, and cuDNN attention's batching rule cannot take a
    # batched [1, 1, Tq, Tk] mask (jax 0.10.2 reshapes it to [B, H, Tq, Tk]).
    q_positions = _true_position(
      jax.lax.axis_index(CONTEXT) * 2 * c + jax.lax.iota(jnp.int32, 2 * c), c, context_ranks
    )
    kv_positions = _true_position(jax.lax.iota(jnp.int32, t), c, context_ranks)
    early_positions = jax.lax.iota(jnp.int32, t // 2)  # chunks 0 .. CP - 1, in order
    out_early = attend(q[:, :c], early(k), early(v), q_positions[:c, None] >= early_positions)
    out_late = attend(q[:, c:], k, v, q_positions[c:, None] >= kv_positions[None, :])
    return jnp.concatenate([out_early, out_late], axis=1)

  # check_vma=False as in sequence.py: under the pipeline's vmaps (which add manual axes)
  # the inputs vary over axes the specs do not name; every collective here is explicit.
  return jax.shard_map(
    local,
    mesh=mesh,
    in_specs=(q_spec, kv_spec, kv_spec),
    out_specs=q_spec,
    axis_names=set(mesh.axis_names),
    check_vma=False,
  )(q, k, v)

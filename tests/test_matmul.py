"""model/matmul.py: the weight matmuls' gradients equal autodiff's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from model import matmul

SPECS = [
  ("btd,dchk->btchk", (2, 8, 16), (16, 3, 2, 4)),  # Q/K/V
  ("bthk,hkd->btd", (2, 8, 2, 4), (2, 4, 16)),  # attention output
  ("btd,df->btf", (2, 8, 16), (16, 64)),  # fc1: x is the narrower operand
  ("btf,fd->btd", (2, 8, 64), (64, 16)),  # fc2: the gradient is
]


@pytest.mark.parametrize("spec,x_shape,w_shape", SPECS)
def test_gradients_match_autodiff(spec, x_shape, w_shape):
  kx, kw, kg = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, x_shape)
  w = jax.random.normal(kw, w_shape)
  cotangent = jax.random.normal(kg, jnp.einsum(spec, x, w).shape)

  def loss(fn):
    return lambda x, w: jnp.sum(fn(spec, x, w) * cotangent)

  got = jax.jit(jax.grad(loss(matmul.einsum), argnums=(0, 1)))(x, w)
  want = jax.jit(jax.grad(loss(jnp.einsum), argnums=(0, 1)))(x, w)
  # The forward pass is jnp.einsum itself (default rtol 1e-7: the same computation).
  np.testing.assert_allclose(matmul.einsum(spec, x, w), jnp.einsum(spec, x, w))
  for g, e in zip(got, want):
    # Another contraction order of the same float32 sums (<= 64 terms of O(1) values).
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)

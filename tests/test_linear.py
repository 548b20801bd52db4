"""`linear`, the one matmul helper: its one-token (row-reduction) and dot paths and the CPU's
transposed weights (`spec.InOut`) against float64."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.models import layers as llama
from jaxinfer.models.spec import InOut


def _check(x, w, out_dtype=None, in_out=False):
    y = llama.linear(x, InOut(w.T) if in_out else w, out_dtype)
    out = jnp.dtype(out_dtype or x.dtype)
    assert y.dtype == out
    got = np.asarray(y.astype(jnp.float32), np.float64)
    want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
    # Inputs are exact in their dtype, products and sums are float32 either way: the only rounding
    # beyond float32 summation (relative ~K * 2^-24 of the sum of |terms|) is the output cast.
    ulp = 2.0 ** -8 if out == jnp.bfloat16 else 2.0 ** -20
    scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)).T
    np.testing.assert_array_less(np.abs(got - want), ulp * np.abs(want) + 1e-5 * scale + 1e-30)


@pytest.mark.parametrize("backend", ["gpu", "native", "native, [in, out]"])
@pytest.mark.parametrize("tokens", [1, 3, 8])
@pytest.mark.parametrize("dtype,out_dtype", [("float32", None), ("bfloat16", None), ("bfloat16", "float32")])
def test_linear_matches_float64(pretend_gpu, backend, tokens, dtype, out_dtype):
    """Every path, on this machine: "gpu" makes a one-token call take the row-reduction path (the
    weight has more rows than columns, as QKV and gate/up); "[in, out]" passes the weight as the
    CPU engine stores it."""
    if backend == "gpu":
        pretend_gpu()
    rng = np.random.default_rng(tokens)
    x = jnp.asarray(rng.standard_normal((tokens, 320)), dtype)
    w = jnp.asarray(rng.standard_normal((384, 320)) / np.sqrt(320), dtype)
    _check(x, w, out_dtype, in_out=backend.endswith("[in, out]"))


def test_embedding_rows_from_a_transposed_table():
    """A tied embedding stored ``[D, V]`` for the lm_head gives the same rows as the ``[V, D]`` table."""
    table = jnp.asarray(np.random.default_rng(1).standard_normal((50, 12)), jnp.float32)
    tokens = jnp.asarray([3, 0, 49, 3], jnp.int32)
    np.testing.assert_array_equal(llama.embed(InOut(table.T), tokens, jnp.float32), table[tokens])


def test_one_token_path_agrees_with_the_batched_one():
    """Natively: on a GPU the first row alone runs as a reduction, inside a batch as a dot."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((4, 1024)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((1024, 1024)) / 32, jnp.bfloat16)
    alone = jax.jit(llama.linear)(x[:1], w).astype(jnp.float32)
    batched = jax.jit(llama.linear)(x, w)[:1].astype(jnp.float32)
    # Both accumulate in float32 and round once to bfloat16: at most one bf16 ulp apart.
    np.testing.assert_array_less(np.abs(alone - batched), 2.0 ** -7 * np.abs(batched) + 1e-6)

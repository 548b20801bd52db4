"""The CPU's native attention kernel (``paged.cpu_attention``) against the jnp reference it stands in
for, on ragged steps of a few tokens: decode tokens, short chunks (speculative verify), padding tokens
and sequences, grouped heads, sliding windows (static and traced), a soft cap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxinfer.paged import cpu_attention
from jaxinfer.paged.attention import ragged_paged_attention as reference
from jaxinfer.paged.kv_cache import BatchMetadata

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu" or not cpu_attention.native.available(),
                                reason="the kernel is the CPU backend's (with a C++ compiler)")


@pytest.fixture(autouse=True)
def vector_build():
    if not cpu_attention.vectorized():
        pytest.skip("this CPU's build of the kernel has no vector paths, so the reference runs instead")


def ragged_case(seed, seqs, *, tokens, page_size=16, kv_heads=3, group=3, head_dim=64, pages_per_seq=8,
                num_seqs=None, layers=3):
    """``seqs``: (tokens already cached, tokens this step) per sequence, packed in order and padded
    to ``tokens``; ``num_seqs`` pads the sequences too."""
    rng = np.random.default_rng(seed)
    num_seqs = num_seqs or len(seqs)
    num_pages = num_seqs * pages_per_seq + 5
    table = rng.permutation(num_pages)[:num_seqs * pages_per_seq].reshape(num_seqs, pages_per_seq)
    q_lens = np.zeros(num_seqs, np.int32)
    seq_lens = np.zeros(num_seqs, np.int32)
    for s, (cached, n) in enumerate(seqs):
        q_lens[s], seq_lens[s] = n, cached + n
    assert seq_lens.max() <= pages_per_seq * page_size and q_lens.sum() <= tokens
    start = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    md = BatchMetadata(slot_mapping=jnp.zeros(tokens, jnp.int32), page_table=jnp.asarray(table, jnp.int32),
                       seq_lens=jnp.asarray(seq_lens), query_start=jnp.asarray(start),
                       logits_indices=jnp.zeros(num_seqs, jnp.int32))
    shape = (layers, num_pages, page_size, kv_heads, head_dim)
    kc, vc = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((tokens, kv_heads * group, head_dim)), jnp.float32)
    new = tuple(jnp.asarray(rng.standard_normal((tokens, kv_heads, head_dim)), jnp.float32) for _ in range(2))
    return q, kc, vc, md, new


CASES = {
    # name: (sequences (cached, this step), padded tokens, options)
    "one_decode": ([(37, 1)], 1, {}),
    "one_decode_first_token": ([(0, 1)], 1, {}),
    "eight_decodes_padded": ([(5, 1), (100, 1), (0, 1), (64, 1), (127, 1)], 8, dict(num_seqs=8)),
    "verify_chunks": ([(20, 4), (3, 5), (90, 1)], 16, {}),
    "page_size_8_gqa_4": ([(30, 2), (61, 1)], 4, dict(page_size=8, kv_heads=2, group=4, pages_per_seq=16)),
    "head_dim_128_mha": ([(40, 3)], 4, dict(kv_heads=2, group=1, head_dim=128)),
    "soft_cap": ([(50, 2), (7, 1)], 4, dict(soft_cap=5.0)),
    "window": ([(90, 3), (10, 1)], 4, dict(window=32)),
    # long contexts: each token's context split into several work items (spans), merged after
    "long_contexts_in_spans": ([(700, 1), (299, 2), (3, 1)], 4, dict(pages_per_seq=48)),
    "long_window_in_spans": ([(500, 2), (40, 1)], 4, dict(window=333, pages_per_seq=32, soft_cap=20.0)),
    "long_head_dim_128": ([(400, 1)], 1, dict(kv_heads=2, group=4, head_dim=128, pages_per_seq=32)),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("layer", [0, 2])
def test_kernel_matches_reference(case, layer):
    seqs, tokens, opts = CASES[case]
    opts = dict(opts)
    attn = dict(scale=0.125, soft_cap=opts.pop("soft_cap", None), sliding_window=opts.pop("window", None))
    q, kc, vc, md, new = ragged_case(list(CASES).index(case), seqs, tokens=tokens, **opts)
    fn = jax.jit(lambda *a: cpu_attention.ragged_paged_attention(*a, md, **attn, new_kv=new), static_argnums=3)
    got = fn(q, kc, vc, layer)
    want = reference(q, kc, vc, layer, md, **attn, new_kv=new)
    real = int(md.query_start[-1])
    np.testing.assert_allclose(got[:real], want[:real], rtol=2e-5, atol=2e-6)
    np.testing.assert_array_equal(got[real:], 0.0)  # padding tokens
    assert cpu_attention.TARGET in fn.lower(q, kc, vc, layer).as_text()


def test_traced_layer_and_window_in_a_scanned_loop():
    """As the CPU's indexed layer loop calls it: the layer and each layer's window traced."""
    q, kc, vc, md, new = ragged_case(7, [(70, 1), (33, 2)], tokens=4)
    windows = jnp.asarray([1 << 30, 16, 40], jnp.int32)

    def run(attention):
        def body(_, xs):
            layer, window = xs
            return None, attention(q, kc, vc, layer, md, scale=0.1, sliding_window=window, new_kv=new)
        return jax.lax.scan(body, None, (jnp.arange(3, dtype=jnp.int32), windows))[1]
    got = jax.jit(lambda: run(cpu_attention.ragged_paged_attention))()
    want = jax.jit(lambda: run(reference))()
    np.testing.assert_allclose(got[:, :3], want[:, :3], rtol=2e-5, atol=2e-6)
    assert not np.allclose(got[0], got[1])  # the windows differ per layer


def test_longer_steps_and_other_caches_take_the_reference():
    q, kc, vc, md, new = ragged_case(3, [(10, 20)], tokens=cpu_attention.MAX_TOKENS + 4)
    lowered = jax.jit(lambda q: cpu_attention.ragged_paged_attention(q, kc, vc, 0, md, scale=0.1, new_kv=new)).lower(q)
    assert cpu_attention.TARGET not in lowered.as_text()
    q, kc, vc, md, new = ragged_case(3, [(10, 1)], tokens=1)
    half = jax.jit(lambda q: cpu_attention.ragged_paged_attention(q, kc.astype(jnp.bfloat16), vc.astype(jnp.bfloat16),
                                                                 0, md, scale=0.1, new_kv=new)).lower(q)
    assert cpu_attention.TARGET not in half.as_text()

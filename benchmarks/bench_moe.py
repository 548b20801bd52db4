"""One layer's routed experts at batch 1 (Mixtral-8x7B shapes, bf16): the ways to apply k of E
experts to one token, timed against each other; the useful bytes are the k experts' weights.

    python benchmarks/bench_moe.py            # writes $OUT/moe_bench.json (or /tmp/moe_bench.json)
    python benchmarks/bench_moe.py --many     # many rows (prefill, large batches): $OUT/moe_many.json

What it settled (H200): float32 row reductions over the gathered experts, which XLA fuses, stream the
chosen experts at the read bandwidth (166 us, 4.24 TB/s, for one layer's two, against 612 us for a
gathered dot, which copies them first); ``ragged_dot``'s GPU lowering is slow at a few rows.
"""

import json
import os
import time

import jax
import jax.numpy as jnp

E, F, D, K = 8, 14336, 4096, 2
f32, bf16 = jnp.float32, jnp.bfloat16


def act(g, u):
    return (jax.nn.silu(g) * u).astype(bf16)


@jax.jit
def gather_dot(x, experts, gu, dn):
    flat, rows = experts.reshape(-1), jnp.repeat(x, K, 0)
    g, u = jnp.split(jnp.einsum("rd,rfd->rf", rows, gu[flat], preferred_element_type=f32), 2, -1)
    return jnp.einsum("rf,rdf->rd", act(g, u), dn[flat], preferred_element_type=f32)


@jax.jit
def slice_dot(x, experts, gu, dn):
    outs = []
    for j in range(K):
        e = experts[0, j]
        h = jnp.einsum("d,fd->f", x[0], jax.lax.dynamic_index_in_dim(gu, e, keepdims=False), preferred_element_type=f32)
        g, u = jnp.split(h, 2, -1)
        w2 = jax.lax.dynamic_index_in_dim(dn, e, keepdims=False)
        outs.append(jnp.einsum("f,df->d", act(g, u), w2, preferred_element_type=f32))
    return jnp.stack(outs)


@jax.jit
def ragged(x, experts, gu, dn):
    flat = experts.reshape(-1)
    order, sizes = jnp.argsort(flat), jnp.bincount(flat, length=E).astype(jnp.int32)
    rows = jnp.repeat(x, K, 0)[order]
    h = jax.lax.ragged_dot(rows, jnp.swapaxes(gu, 1, 2), sizes, preferred_element_type=f32)
    g, u = jnp.split(h, 2, -1)
    o = jax.lax.ragged_dot(act(g, u), jnp.swapaxes(dn, 1, 2), sizes, preferred_element_type=f32)
    return jnp.zeros_like(o).at[order].set(o)


@jax.jit
def all_experts(x, experts, gu, dn):  # reads every expert: what a dense layer would cost
    g, u = jnp.split(jnp.einsum("d,efd->ef", x[0], gu, preferred_element_type=f32), 2, -1)
    return jnp.einsum("ef,edf->ed", act(g, u), dn, preferred_element_type=f32)[experts[0]]


@jax.jit
def row_reductions(x, experts, gu, dn):  # what jaxinfer.models.layers.moe_partial runs on GPU
    flat, rows = experts.reshape(-1), jnp.repeat(x, K, 0)
    g, u = jnp.split(jnp.sum(rows[:, None, :].astype(f32) * gu[flat].astype(f32), -1), 2, -1)
    return jnp.sum(act(g, u)[:, None, :].astype(f32) * dn[flat].astype(f32), -1)


def main():
    key = jax.random.key(0)
    gu = jax.random.normal(key, (E, 2 * F, D), bf16) * 0.01
    dn = jax.random.normal(key, (E, D, F), bf16) * 0.01
    x = jax.random.normal(key, (1, D), bf16)
    experts = jnp.array([[3, 6]], jnp.int32)
    useful = K * 3 * F * D * 2  # bytes of the k experts' gate, up and down
    results, ref = {}, None
    for fn in (gather_dot, slice_dot, ragged, all_experts, row_reductions):
        out = fn(x, experts, gu, dn).block_until_ready()
        best = float("inf")
        for _ in range(5):
            t = time.perf_counter()
            for _ in range(50):
                out = fn(x, experts, gu, dn)
            out.block_until_ready()
            best = min(best, (time.perf_counter() - t) / 50)
        ref = out if ref is None else ref
        results[fn.__name__] = dict(us=best * 1e6, tb_s=useful / best / 1e12,
                                    max_abs_diff_vs_first=float(jnp.max(jnp.abs(out - ref))))
        print(f"{fn.__name__:<16} {best * 1e6:9.1f} us {useful / best / 1e12:6.2f} TB/s", flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "moe_bench.json"), "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, **results), f, indent=1)


def _time(fn, *args):
    out = fn(*args).block_until_ready()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(10):
            out = fn(*args)
        out.block_until_ready()
        best = min(best, (time.perf_counter() - t) / 10)
    return best, out


def many():
    """Many (token, expert) rows, as prefill and large decode batches give: XLA's ``ragged_dot``
    against JAX's Pallas Triton lowering of it (where this jax has the flag) and all experts densely.
    (JAX's Mosaic GPU example kernel ``ragged_dot_mgpu`` aborted the process while compiling on the
    H200 with jax 0.11.2, so it is not among them.)"""
    from jax._src import config as jax_config  # the flag has no public context manager

    triton = getattr(jax_config, "jax_ragged_dot_use_gpu_pallas_triton_lowering", None)
    key = jax.random.key(0)
    gu = jax.random.normal(key, (E, 2 * F, D), bf16) * 0.01
    dn = jax.random.normal(key, (E, D, F), bf16) * 0.01

    def grouped(rows, sizes, mm):
        g, u = jnp.split(mm(rows, gu, sizes), 2, -1)
        return mm(act(g, u), dn, sizes)

    def xla(rows, w, sizes):
        return jax.lax.ragged_dot(rows, jnp.swapaxes(w, 1, 2), sizes, preferred_element_type=f32)

    def dense(rows, sizes):  # every expert on every row, the row's own expert kept
        ids = jnp.repeat(jnp.arange(E), sizes, total_repeat_length=rows.shape[0])
        g, u = jnp.split(jnp.einsum("rd,efd->ref", rows, gu, preferred_element_type=f32), 2, -1)
        o = jnp.einsum("ref,edf->red", act(g, u), dn, preferred_element_type=f32)
        return jnp.take_along_axis(o, ids[:, None, None], 1)[:, 0]

    results = []
    for tokens in (4, 32, 128, 256, 512, 1024, 2048):
        r = tokens * K
        rows = jax.random.normal(jax.random.key(1), (r, D), bf16)
        flat = jnp.sort(jax.random.randint(jax.random.key(2), (r,), 0, E))
        sizes = jnp.bincount(flat, length=E).astype(jnp.int32)
        row = dict(tokens=tokens, rows=r)
        t, ref = _time(jax.jit(lambda x, s: grouped(x, s, xla)), rows, sizes)
        row["xla_ragged_us"] = t * 1e6
        if triton is not None:  # JAX's Pallas Triton lowering of ragged_dot (a jax flag, off by default)
            with triton(True):
                t, out = _time(jax.jit(lambda x, s: grouped(x, s, xla)), rows, sizes)
            row["triton_ragged_us"] = t * 1e6
            row["triton_max_rel_err"] = float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))
        if tokens <= 1024:
            t, out = _time(jax.jit(dense), rows, sizes)
            row["dense_all_us"] = t * 1e6
        results.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(os.environ.get("OUT", "/tmp"), "moe_many.json"), "w") as f:
        json.dump(dict(device=jax.devices()[0].device_kind, results=results), f, indent=1)


if __name__ == "__main__":
    import sys

    many() if "--many" in sys.argv else main()

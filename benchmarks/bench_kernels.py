"""Time the attention kernels on the current device against its ceilings and peer implementations.

Cases (defaults are llama3-8b's attention shapes; ``--heads/--kv-heads/--head-dim/--soft-cap/--window`` give
other families' attention, e.g. Gemma-2-9B's ``--heads 16 --kv-heads 8 --head-dim 256 --soft-cap 50
--window 4096 --ctx 8192``, Qwen2.5-7B's ``--heads 28 --kv-heads 4``):
- decode: 64 sequences x 4096 context, 32 q heads / 8 kv heads, head_dim 128, bf16, page_size 64
  (and 16, the engine's default), pages scattered over the pool; reported as achieved HBM bandwidth =
  K/V bytes the queries can see (with a window, only its keys) / time. With ``--window`` also: the
  window passed traced (as the scanned layer loop does) and the same call with no window (the
  whole context: what skipping the keys before the window saves).
- prefill: 8 x 2048 causal (whole prompts as one chunk), same heads; reported as TFLOP/s
  (4 * D * heads * sum over queries of visible keys, the window's only).
Ceilings measured in the same run: read bandwidth (sum over a multi-GB array) and the bf16 matmul
rate (8192^3). Peers: our reference attention under jit (XLA gather + einsum), and the deprecated
``jax.experimental.pallas.ops.gpu.paged_attention`` (decode only; cache re-laid out for it, untimed).
``--kv-cache-dtype int8|fp8``: every case over a quantized cache (codes and a float32 scale per token
and kv head, as the engine's ``kv_cache_dtype``; the bytes counted are the codes' and the scales'),
the reference attention reading the same codes; the deprecated op, which reads no codes, is left out.
Timing: warm-up, then ``--reps`` repetitions of ``--inner`` back-to-back calls ending in
block_until_ready; the median per call is reported. Prints a table, writes JSON to ``--out``.

    PYTHONPATH=. python3 benchmarks/bench_kernels.py --out /tmp/kernels.json
    PYTHONPATH=. python3 benchmarks/bench_kernels.py --kv-cache-dtype fp8 --page-size 16 --seqs 256 --ctx 640 \
        --sweep --out /tmp/kernels_fp8.json   # the throughput run's decode steps, over an fp8 cache
    PYTHONPATH=. python3 benchmarks/bench_kernels.py --heads 16 --kv-heads 8 --head-dim 256 --soft-cap 50 \
        --window 4096 --ctx 8192 --out /tmp/kernels_gemma2.json
"""

from __future__ import annotations

import argparse
import functools
import json
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from ceilings import matmul_rate, read_bandwidth, timeit  # benchmarks/ is on sys.path when run as a script
from device_profile import kernel_times
from jaxinfer.paged.attention import ragged_paged_attention as reference
from jaxinfer.paged.kv_cache import BatchMetadata, kv_storage_dtype, pack_codes, quantize
from jaxinfer.pallas_kernels import gpu


def make_case(rng, num_seqs, ctx, q_len, *, heads, kv_heads, head_dim, page_size, dtype, num_layers=2):
    pages_per_seq = ctx // page_size
    num_pages = num_seqs * pages_per_seq + 16
    page_table = rng.permutation(num_pages)[:num_seqs * pages_per_seq].reshape(num_seqs, pages_per_seq)
    shape = (num_layers, num_pages, page_size, kv_heads, head_dim)
    key = jax.random.key(0)
    kc = jax.random.normal(key, shape, dtype)
    vc = jax.random.normal(jax.random.fold_in(key, 1), shape, dtype)
    num_tokens = num_seqs * q_len
    q = jax.random.normal(jax.random.fold_in(key, 2), (num_tokens, heads, head_dim), dtype)
    md = BatchMetadata(
        slot_mapping=jnp.zeros((num_tokens,), jnp.int32),
        page_table=jnp.asarray(page_table, jnp.int32),
        seq_lens=jnp.full((num_seqs,), ctx, jnp.int32),
        query_start=jnp.arange(num_seqs + 1, dtype=jnp.int32) * q_len,
        logits_indices=jnp.zeros((num_seqs,), jnp.int32),
    )
    return q, kc, vc, md


def quantized(kc, vc, dtype: str):
    """``(k, v, scales)``: the cache as codes of ``dtype`` (stored as the engine stores them: fp8 as
    words, ``kv_cache.pack_codes``) and the ``k_scale``/``v_scale`` keywords of the attention
    functions; bf16: the cache as it is and no keywords."""
    if dtype == "bf16":
        return kc, vc, {}
    d = kv_storage_dtype(dtype, kc.dtype)
    (kq, ks), (vq, vs) = quantize(kc, d), quantize(vc, d)
    return pack_codes(kq), pack_codes(vq), dict(k_scale=ks, v_scale=vs)


def rel_err(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def run(name, results, fn):
    try:
        results[name] = fn()
        print(f"  {name}: {results[name]}", flush=True)
    except Exception as e:  # a failing peer must not hide the other numbers
        results[name] = {"error": f"{type(e).__name__}: {e}"[:500]}
        traceback.print_exc()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="kernels.json")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--sweep", action="store_true", help="also try other kernel configurations")
    ap.add_argument("--small", action="store_true", help="tiny shapes, interpret mode off-GPU: a smoke test")
    ap.add_argument("--only", choices=("all", "decode"), default="all",
                    help="decode: only our default decode kernel (for a profiler)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--page-size", type=int, default=64)
    ap.add_argument("--soft-cap", type=float, default=None, help="tanh cap on the scores (Gemma 2: 50)")
    ap.add_argument("--window", type=int, default=None, help="sliding window (Mistral, Gemma's local layers)")
    ap.add_argument("--kv-cache-dtype", choices=("bf16", "int8", "fp8"), default="bf16",
                    help="the cache's element type (int8/fp8: codes plus per-token scales)")
    ap.add_argument("--seqs", type=int, default=64, help="decode sequences")
    ap.add_argument("--ctx", type=int, default=4096, help="decode context per sequence")
    ap.add_argument("--prefill-seqs", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=2048)
    args = ap.parse_args()
    small = args.small
    interp = {} if jax.default_backend() == "gpu" else {"interpret": True}
    tm = functools.partial(timeit, reps=args.reps, inner=args.inner)
    dev = jax.devices()[0]
    res = {"device": getattr(dev, "device_kind", str(dev)), "jax": jax.__version__}
    print(res, flush=True)
    rng = np.random.default_rng(0)
    heads, kv_heads, hd, ps, dt = args.heads, args.kv_heads, args.head_dim, args.page_size, jnp.bfloat16
    window = args.window
    attn = dict(scale=hd ** -0.5, soft_cap=args.soft_cap, sliding_window=window)
    res["attention"] = dict(heads=heads, kv_heads=kv_heads, head_dim=hd, soft_cap=args.soft_cap, window=window)

    def read_bw():
        bw = read_bandwidth(64 << 20 if small else 4 << 30)
        return {"seconds": (64 << 20 if small else 4 << 30) / bw, "TB/s": bw / 1e12}

    def matmul():
        n = 512 if small else 8192
        rate = matmul_rate(n, jnp.bfloat16)
        return {"seconds": 2 * n ** 3 / rate, "TFLOP/s": rate / 1e12}

    if args.only == "all":
        run("read_bandwidth", res, read_bw)
        run("matmul_bf16_8192", res, matmul)

    # ---- decode
    S, ctx = (4, 256) if small else (args.seqs, args.ctx)
    kvd = args.kv_cache_dtype
    q, kc, vc, md = make_case(rng, S, ctx, 1, heads=heads, kv_heads=kv_heads, head_dim=hd, page_size=ps, dtype=dt)
    kc, vc, sc = quantized(kc, vc, kvd)
    token_bytes = kv_heads * (kc.shape[-1] * kc.dtype.itemsize + (4 if sc else 0))  # codes (+ a float32 scale) a kv head
    kv_bytes = 2 * S * min(ctx, window or ctx) * token_bytes  # what the queries see
    res["decode_case"] = dict(seqs=S, ctx=ctx, heads=heads, kv_heads=kv_heads, head_dim=hd, page_size=ps,
                              dtype="bf16", kv_cache_dtype=kvd, kv_bytes=kv_bytes)
    layer = jnp.int32(1)
    ref_jit = jax.jit(functools.partial(reference, **attn))
    ref_out = ref_jit(q, kc, vc, layer, md, **sc) if args.only == "all" else None

    def ours(case=None, traced_window=False, **cfg):
        """Our decode kernel on the main case, or on another ``case`` (q, k, v, md, scales) of the same
        size; ``traced_window``: the window as a jit argument, as the scanned layer loop passes it."""
        cq, ck, cv, cmd, csc = case or (q, kc, vc, md, sc)
        want = ref_jit(cq, ck, cv, layer, cmd, **csc) if case else ref_out
        kw = dict(attn, **cfg)
        if traced_window:
            w = jnp.int32(kw.pop("sliding_window"))
            g = jax.jit(lambda *a, **s: gpu.ragged_paged_attention(*a[:-1], sliding_window=a[-1], **kw, **s, **interp))
            f = lambda *a: g(*a, w, **csc)  # noqa: E731
        else:
            f = functools.partial(jax.jit(functools.partial(gpu.ragged_paged_attention, **kw, **interp)), **csc)
        err = rel_err(f(cq, ck, cv, layer, cmd), want) if want is not None else None
        t = tm(f, cq, ck, cv, layer, cmd)
        return {"seconds": t, "TB/s": kv_bytes / t / 1e12, "rel_err": err,
                "cfg": dict(cfg, page_size=ck.shape[2], traced_window=traced_window)}

    run("decode_ours", res, ours)
    if args.only == "decode":
        return
    if window is not None:
        run("decode_ours_traced_window", res, functools.partial(ours, traced_window=True))

        def no_window():  # the whole context read: the rate is of the window's bytes, so it shows the saving
            f = jax.jit(functools.partial(gpu.ragged_paged_attention, **dict(attn, sliding_window=None), **interp))
            t = tm(functools.partial(f, **sc), q, kc, vc, layer, md)
            return {"seconds": t, "TB/s (window bytes)": kv_bytes / t / 1e12,
                    "TB/s": kv_bytes * ctx / min(ctx, window) / t / 1e12}
        run("decode_ours_no_window_whole_context", res, no_window)

    def kernel_only():  # the decode kernel's own device time (profiler), without the XLA glue around it
        f = functools.partial(jax.jit(functools.partial(gpu.ragged_paged_attention, **attn, **interp)), **sc)
        t = kernel_times(f, q, kc, vc, layer, md).get("paged_decode_gpu")
        return {"seconds": t, "TB/s": kv_bytes / t / 1e12} if t else {"error": "no device trace (CPU?)"}

    run("decode_ours_kernel_only", res, kernel_only)

    # The engine's default page size: 4 pages per key block, gathered through the page table (made
    # once, shared by the sweep's configurations).
    @functools.cache
    def page16():
        cq, ck, cv, cmd = make_case(np.random.default_rng(0), S, ctx, 1, heads=heads, kv_heads=kv_heads, head_dim=hd,
                                    page_size=16, dtype=dt)
        ck, cv, csc = quantized(ck, cv, kvd)
        return cq, ck, cv, cmd, csc

    run("decode_ours_page16", res, lambda: ours(page16()))
    if args.sweep:
        # warps and key blocks at page 16 (an 8-bit cache's loop is twice bf16's instructions a warp:
        # benchmarks/kernel_sass.py)
        for bk, warps in ((64, 8), (128, 4), (128, 8)):
            run(f"decode_ours_page16_bk{bk}_w{warps}", res,
                lambda bk=bk, warps=warps: ours(page16(), decode_block_k=bk, decode_warps=warps))
        for splits in (1, 2, 4, 8):
            for stages in (2, 3):
                cfg = dict(num_splits=splits, decode_stages=stages)
                run(f"decode_ours_s{splits}_st{stages}", res, functools.partial(ours, **cfg))
        if hd > 128:  # the shared-memory plan's choices (gpu._fit) against its neighbours
            for bk, stages in ((32, 3), (64, 2), (64, 1), (128, 1)):
                cfg = dict(decode_block_k=bk, decode_stages=stages)
                run(f"decode_ours_bk{bk}_st{stages}", res, functools.partial(ours, **cfg))
    run("decode_xla_reference", res, lambda: {"seconds": (t := tm(functools.partial(ref_jit, **sc), q, kc, vc, layer, md)),
                                              "TB/s": kv_bytes / t / 1e12})

    def old_pallas(**cfg):
        from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention
        kp = jnp.transpose(kc[1], (2, 0, 1, 3))  # [KVH, pages, page_size, D]
        vp = jnp.transpose(vc[1], (2, 0, 1, 3))
        f = jax.jit(functools.partial(paged_attention, **interp, **cfg))
        qs = q * attn["scale"]
        err = rel_err(f(qs, kp, vp, md.page_table, md.seq_lens), ref_out)
        t = tm(f, qs, kp, vp, md.page_table, md.seq_lens)
        return {"seconds": t, "TB/s": kv_bytes / t / 1e12, "rel_err": err, "cfg": cfg}

    if args.soft_cap is None and window is None and not sc:  # the deprecated op has neither, nor codes
        run("decode_pallas_ops_gpu_paged_attention", res, old_pallas)
        if args.sweep:
            run("decode_pallas_ops_gpu_paged_attention_2", res,
                functools.partial(old_pallas, pages_per_compute_block=4, k_splits=8, num_warps=4))
    del kc, vc, ref_out

    # ---- prefill
    S, ctx = (2, 128) if small else (args.prefill_seqs, args.prefill_len)
    q, kc, vc, md = make_case(rng, S, ctx, ctx, heads=heads, kv_heads=kv_heads, head_dim=hd, page_size=ps,
                              dtype=dt)
    kc, vc, sc = quantized(kc, vc, kvd)
    visible = np.minimum(np.arange(1, ctx + 1), window or ctx)  # keys each query sees
    flops = 4 * hd * heads * S * int(visible.sum())
    res["prefill_case"] = dict(seqs=S, q_len=ctx, ctx=ctx, heads=heads, kv_heads=kv_heads, head_dim=hd,
                               page_size=ps, dtype="bf16", kv_cache_dtype=kvd, causal_flops=flops)
    ref_out = ref_jit(q, kc, vc, layer, md, **sc)

    def ours_pre(**cfg):
        f = functools.partial(jax.jit(functools.partial(gpu.ragged_paged_attention, **attn, **interp, **cfg)), **sc)
        err = rel_err(f(q, kc, vc, layer, md), ref_out)
        t = tm(f, q, kc, vc, layer, md)
        return {"seconds": t, "TFLOP/s": flops / t / 1e12, "rel_err": err, "cfg": cfg}

    run("prefill_ours", res, ours_pre)
    if args.sweep:
        for bk in (64,):
            for rows, warps, stages in ((128, 4, 2), (128, 4, 3), (64, 4, 2), (64, 8, 2), (128, 8, 2)):
                cfg = dict(prefill_block_k=bk, prefill_rows=rows, prefill_warps=warps, prefill_stages=stages)
                run(f"prefill_ours_bk{bk}_r{rows}_w{warps}_st{stages}", res, functools.partial(ours_pre, **cfg))
    run("prefill_xla_reference", res, lambda: {"seconds": (t := tm(functools.partial(ref_jit, **sc), q, kc, vc, layer, md,
                                                                   reps=3, inner=2)),
                                               "TFLOP/s": flops / t / 1e12})

    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)
    print_table(res)


def print_table(res):
    def get(k, field):
        v = res.get(k, {})
        return v.get(field) if isinstance(v, dict) else None

    print(f"\ndevice {res['device']}, jax {res['jax']}")
    print(f"{'case':<48}{'ms':>9}{'rate':>14}{'rel_err':>10}")
    for k, v in res.items():
        if not isinstance(v, dict) or "seconds" not in v and "error" not in v:
            continue
        if "error" in v:
            print(f"{k:<48}{'failed':>9}  {v['error'][:60]}")
            continue
        rate = f"{v['TB/s']:.2f} TB/s" if "TB/s" in v else f"{v['TFLOP/s']:.0f} TFLOP/s"
        err = f"{v['rel_err']:.1e}" if v.get("rel_err") is not None else ""
        print(f"{k:<48}{v['seconds'] * 1e3:>9.3f}{rate:>14}{err:>10}")
    bw = get("read_bandwidth", "TB/s")

    # Contenders are whole-function timings: the kernel-only row is a breakdown, the no-window row a reference.
    def whole(k, v):
        return isinstance(v, dict) and not k.endswith(("_kernel_only", "_whole_context"))
    for case, field in (("decode_ours", "TB/s"), ("prefill_ours", "TFLOP/s")):
        best = max(((v[field], k) for k, v in res.items() if k.startswith(case) and whole(k, v) and field in v),
                   default=None)
        if best:
            print(f"best {case}: {best[1]} {best[0]:.2f} {field}")
    dec = [v["TB/s"] for k, v in res.items() if k.startswith("decode_ours") and whole(k, v) and "TB/s" in v]
    if bw and dec:
        print(f"best decode: {max(dec):.2f} TB/s = {100 * max(dec) / bw:.0f}% of measured read bandwidth")
    alone = get("decode_ours_kernel_only", "TB/s")
    if bw and alone:
        print(f"decode kernel alone (profiler): {alone:.2f} TB/s = {100 * alone / bw:.0f}% of measured read bandwidth")

if __name__ == "__main__":
    main()

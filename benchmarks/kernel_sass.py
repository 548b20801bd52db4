"""Our Pallas (Triton) GPU kernels as the GPU would run them, read on a machine without a GPU.

GPU time is scarce and kernels are mostly tuned by what the SASS says (instructions per element,
registers, whether tiles reach the tensor cores by ``ldmatrix``): this lowers a kernel for CUDA on
the CPU (``lowering_platforms=("cuda",)``), takes each Pallas call's Triton module as it is lowered,
compiles it with the ``triton`` package's own ``ptxas`` for sm_90 (``pip install triton``; XLA's
Triton may differ by a few instructions) at the call's warps and stages, and prints per kernel: the
registers a thread, the instructions in all and in its main loop (between a back edge and its
target), and the loop's commonest opcodes. Presets:

- ``decode-attention``: ``pallas_kernels.gpu.ragged_paged_attention`` on a decode batch (``--seqs`` x
  ``--ctx``, llama3-8b's heads, page 16) over a ``--kv`` cache (bf16, fp8, int8); the prefill kernel
  that a step of that many tokens may also launch comes with it;
- ``qmatvec``: the quantized matvec on one llama3-8b weight (``--shape``) in ``--scheme``.

    pip install triton   # the compiler only; not a dependency of jaxinfer
    PYTHONPATH=. python benchmarks/kernel_sass.py decode-attention --kv fp8 --warps 8
    PYTHONPATH=. python benchmarks/kernel_sass.py qmatvec --scheme int4-g128 --shape w_gate_up --out /tmp/q.json
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import re
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np


def triton_modules(fn, *args) -> list[dict]:
    """Each Pallas Triton call that lowering ``fn(*args)`` for CUDA makes: name, warps, stages, TTIR."""
    from jax._src.pallas.triton import pallas_call_registration as registration
    lower, texts = registration.lowering.lower_jaxpr_to_triton_module, []

    def keep(*a, **k):
        result = lower(*a, **k)
        texts.append(result.module.operation.get_asm())
        return result

    registration.lowering.lower_jaxpr_to_triton_module = keep
    try:
        hlo = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    finally:
        registration.lowering.lower_jaxpr_to_triton_module = lower
    calls = re.findall(r'name = "([^"]+)", num_stages = (\d+) : i32, num_warps = (\d+) : i32', hlo)
    if len(calls) != len(texts):
        raise RuntimeError(f"{len(texts)} Triton modules lowered but {len(calls)} calls in the HLO")
    return [dict(name=n, stages=int(s), warps=int(w), ttir=t) for (n, s, w), t in zip(calls, texts)]


def sass(ttir: str, warps: int, stages: int, capability: int = 90) -> tuple[str, int]:
    """The SASS of one module compiled by the ``triton`` package, and its registers a thread."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, said explicitly
    import triton
    from triton.backends.compiler import GPUTarget
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as d:
        src, cubin = os.path.join(d, "k.ttir"), os.path.join(d, "k.cubin")
        with open(src, "w") as f:
            f.write(ttir)
        kernel = triton.compile(src, target=GPUTarget("cuda", capability, 32),
                                options=dict(num_warps=warps, num_stages=stages))
        with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
        text = subprocess.run([os.path.join(tools, "cuobjdump"), "-sass", cubin], capture_output=True, text=True,
                              check=True).stdout
        usage = subprocess.run([os.path.join(tools, "cuobjdump"), "-res-usage", cubin], capture_output=True,
                               text=True, check=True).stdout
    return text, int(re.search(r"REG:(\d+)", usage).group(1))


def loop_stats(text: str) -> dict:
    """Instructions in all and in each loop (a branch back to an earlier address), with opcodes."""
    ins = [(int(a, 16), op) for a, op in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", text)]
    opcode = lambda t: re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]  # noqa: E731
    loops = []
    for addr, t in ins:
        target = re.search(r"BRA\s.*?0x([0-9a-f]+)", t)
        if target and int(target.group(1), 16) < addr:
            body = [opcode(op) for a, op in ins if int(target.group(1), 16) <= a <= addr]
            loops.append(dict(instructions=len(body), opcodes=dict(collections.Counter(body).most_common(12))))
    return dict(instructions=len(ins), loops=loops)


def decode_attention(args):
    from bench_kernels import make_case, quantized  # benchmarks/ is on sys.path when run as a script
    from jaxinfer.pallas_kernels import gpu
    q, k, v, md = make_case(np.random.default_rng(0), args.seqs, args.ctx, 1, heads=32, kv_heads=8, head_dim=128,
                            page_size=16, dtype=jnp.bfloat16)
    k, v, scales = quantized(k, v, args.kv)
    f = functools.partial(gpu.ragged_paged_attention, scale=128 ** -0.5, decode_block_k=args.block_k,
                          decode_warps=args.warps, decode_stages=args.stages, prefill_warps=args.prefill_warps,
                          **scales)
    return lambda q, k, v: f(q, k, v, 1, md), (q, k, v)


def qmatvec(args):
    from bench_qmatvec import SHAPES, random_qarray
    from jaxinfer.quant.matmul import kernel_matvec
    out, n_in = SHAPES[args.shape]
    w = random_qarray(jax.random.key(0), out, n_in, args.scheme)
    x = jnp.ones((1, n_in), jnp.bfloat16)
    return lambda x, w: kernel_matvec(x, w, jnp.bfloat16), (x, w)


PRESETS = {"decode-attention": decode_attention, "qmatvec": qmatvec}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("preset", choices=sorted(PRESETS))
    p.add_argument("--kv", default="bf16", choices=["bf16", "fp8", "int8"], help="decode-attention: cache dtype")
    p.add_argument("--seqs", type=int, default=256, help="decode-attention: sequences")
    p.add_argument("--ctx", type=int, default=640, help="decode-attention: context (a loop needs > block_k)")
    p.add_argument("--block_k", type=int, default=64, help="decode-attention: key block")
    p.add_argument("--warps", type=int, default=4, help="decode-attention: warps a program")
    p.add_argument("--stages", type=int, default=3, help="decode-attention: pipeline stages")
    p.add_argument("--prefill_warps", type=int, default=None, help="decode-attention: the prefill kernel's warps "
                   "(lowered beside the decode kernel; default: its own choice)")
    p.add_argument("--scheme", default="int8", help="qmatvec: int8, int4-g32/g64/g128, q8_0, q4_0, q4_1")
    p.add_argument("--shape", default="w_gate_up", help="qmatvec: wqkv, wo, w_gate_up, w_down, lm_head")
    p.add_argument("--out", help="JSON with every kernel's figures")
    args = p.parse_args()
    fn, inputs = PRESETS[args.preset](args)
    result = []
    for m in triton_modules(fn, *inputs):
        text, registers = sass(m["ttir"], m["warps"], m["stages"])
        result.append(dict(name=m["name"], warps=m["warps"], stages=m["stages"], registers=registers,
                           **loop_stats(text)))
    for r in result:
        print(f"{r['name']}: {r['warps']} warps, {r['stages']} stages, {r['registers']} registers, "
              f"{r['instructions']} instructions")
        for i, loop in enumerate(r["loops"]):
            ops = ", ".join(f"{k} {v}" for k, v in loop["opcodes"].items())
            print(f"  loop {i}: {loop['instructions']} instructions; {ops}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(preset=args.preset, args=vars(args), kernels=result), f, indent=2)


if __name__ == "__main__":
    main()

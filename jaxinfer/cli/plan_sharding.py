"""Plan a sharded model without the memory for it: lower and compile one engine step of ``--model``
over ``--tensor-parallel-size`` devices from abstract shapes (``jax.ShapeDtypeStruct`` with shardings,
nothing allocated), and report each device's bytes from the compiled executable's memory analysis.

    jaxinfer plan-sharding --model llama3-70b --tensor-parallel-size 8 --out $OUT/plan_70b.json

With ``--host-devices`` (the default) it plans on ``--tensor-parallel-size`` forced CPU host devices,
so llama3-70b on 8 devices is planned on any machine; ``--no-host-devices`` uses the real devices.
"""

from __future__ import annotations

import json
import os
import time

from jaxinfer.cli.options import Parser

GIB = 2**30


def parser() -> Parser:
    p = Parser("jaxinfer plan-sharding", __doc__)
    p.option(None, "model", default="llama3-70b", help="Preset name, local Hugging Face directory or .gguf file "
             "(its config) [default: llama3-70b].")
    p.option(None, "tensor-parallel-size", "tensor-parallel", type=int, default=8,
             help="Devices the model is split over [default: 8].")
    p.option(None, "dtype", choices=("float32", "bfloat16"), default="bfloat16", help="Weights and KV cache dtype.")
    p.option(None, "num-pages", type=int, default=2048, help="KV pool pages (the pool every device holds its KV "
             "heads of) [default: 2048].")
    p.option(None, "page-size", type=int, default=16, help="Tokens per page [default: 16].")
    p.option(None, "tokens", type=int, default=256, help="Tokens of the planned step (its token bucket).")
    p.option(None, "seqs", type=int, default=32, help="Sequences of the planned step.")
    p.option(None, "pages-per-seq", type=int, default=256, help="Pages per sequence of the planned step.")
    p.option(None, "out", default="results/plan_sharding.json", help="Where to write the JSON report.")
    p.flag(None, "host-devices", default=True, help="Plan on --tensor-parallel-size forced CPU host devices.")
    return p


def main(argv: list[str]) -> None:
    args = parser().parse(argv)
    tp = args.tensor_parallel_size
    if args.host_devices:  # before JAX starts (nothing above imports it)
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={tp}"
        os.environ["JAX_PLATFORMS"] = "cpu"
    report = plan(args.model, tp, args.dtype, args.num_pages, args.page_size, args.tokens, args.seqs,
                  args.pages_per_seq)
    print_report(report)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(f"wrote {args.out}")


def plan(model: str, tensor_parallel: int, dtype_name: str, num_pages: int, page_size: int, tokens: int, seqs: int,
         pages_per_seq: int) -> dict:
    """Compile one step of ``tokens`` x ``seqs`` x ``pages_per_seq`` over ``tensor_parallel`` devices from
    abstract shapes; the report of its bytes per device."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxinfer.batching.config import EngineConfig
    from jaxinfer.batching.inputs import pack_inputs
    from jaxinfer.batching.model_runner import ModelRunner
    from jaxinfer.batching.resolve import DeviceFacts, ModelFacts, resolve
    from jaxinfer.models import sharding
    from jaxinfer.models.spec import num_params
    from jaxinfer.models.weights import load_config, resolve_model
    from jaxinfer.paged.kv_cache import KVCache

    config = load_config(resolve_model(model)).replace(layer_loop="scan")
    dtype = jnp.dtype(dtype_name)
    mesh = sharding.replica_mesh(config, tensor_parallel, jax.device_count() // tensor_parallel)
    weights = sharding.abstract_sharded_weights(config, mesh, dtype)
    kv_shape = (config.num_layers, num_pages, page_size, sharding.kv_heads(config, tensor_parallel), config.head_dim)
    kv = jax.ShapeDtypeStruct(kv_shape, dtype, sharding=sharding.cache_sharding(mesh).k)
    cache = KVCache(kv, kv)
    t, s, p = tokens, seqs, pages_per_seq
    resolved = resolve(EngineConfig(
        tensor_parallel=tensor_parallel, data_parallel=jax.device_count() // tensor_parallel, dtype=dtype_name,
        num_pages=num_pages, page_size=page_size, max_num_seqs=s, max_num_batched_tokens=t,
        max_model_len=p * page_size, token_buckets=(t,), seq_buckets=(s,), page_buckets=(p,), layer_loop="scan",
        num_scheduler_steps=1, compilation_cache_dir=""), ModelFacts(model, config, "preset"),
        DeviceFacts(jax.default_backend()))
    ops = sharding.sharded_ops(resolved.backend.ops(resolved.attention_backend, config.head_dim, False), config, mesh)
    runner = ModelRunner(resolved, config, weights, cache, ops, mesh=mesh)
    x = runner.inputs.placeholder((t, s, p), decode_only=False)
    inputs, packing = pack_inputs((x.tokens, x.positions, x.md, x.sb))
    t0 = time.perf_counter()
    lowered = runner._step.lower(weights, cache, runner.last_tokens, inputs, spec=runner.compiler.spec,
                                 packing=packing, greedy_only=True, num_logprobs=None, logit_terms=False)
    compiled = lowered.compile()
    seconds = time.perf_counter() - t0
    mem = compiled.memory_analysis()

    def per_device(tree):  # the bytes of one device's shard of each leaf
        return sum(int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize for x in jax.tree.leaves(tree))

    report = dict(
        model=model, tensor_parallel=tensor_parallel, dtype=dtype_name, backend=jax.default_backend(),
        num_params=num_params(config), weight_bytes_total=num_params(config) * dtype.itemsize,
        weight_bytes_per_device=per_device(weights), kv_bytes_per_device=per_device(cache),
        kv_tokens=num_pages * page_size, step=dict(tokens=t, seqs=s, pages_per_seq=p),
        compile_seconds=round(seconds, 1),
        memory_analysis=dict(argument_bytes=mem.argument_size_in_bytes, output_bytes=mem.output_size_in_bytes,
                             alias_bytes=mem.alias_size_in_bytes, temp_bytes=mem.temp_size_in_bytes,
                             generated_code_bytes=mem.generated_code_size_in_bytes))
    report["per_device_peak_bytes_estimate"] = (mem.argument_size_in_bytes + mem.output_size_in_bytes
                                                - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
    return report


def print_report(report: dict) -> None:
    mem, tp = report["memory_analysis"], report["tensor_parallel"]
    print(f"{report['model']} over {tp} {report['backend']} devices ({report['dtype']}), compiled in "
          f"{report['compile_seconds']:.0f}s")
    print(f"{'':24}{'GiB per device':>16}")
    for name, b in (("weights", report["weight_bytes_per_device"]), ("KV cache", report["kv_bytes_per_device"]),
                    ("arguments (analysis)", mem["argument_bytes"]), ("temporaries (analysis)", mem["temp_bytes"]),
                    ("peak estimate", report["per_device_peak_bytes_estimate"])):
        print(f"{name:24}{b / GIB:16.2f}")
    print(f"{'whole model / devices':24}{report['weight_bytes_total'] / tp / GIB:16.2f}")

"""How long quantizing at load takes: one decoder layer of a preset (random float weights of the
spec's shapes) quantized by each scheme, leaf by leaf as the loaders do, on whatever device JAX
has. The first call of a shape includes its compilation; the figure that scales to a whole model is
the second (a model's layers share shapes, so they compile once). Multiply by ``num_layers`` for the
model's load-time cost (lm_head aside). int4 loads also run the first token through each float layer
(``decoder.first_token_layer``, for the matrices' importance): timed once, as ``first_token``; their
matrices are quantized with an importance (the weighted search), as the loaders do.

    python benchmarks/bench_quantize.py --model llama3-8b --schemes int8,int4-g64,int4-g128,fp8
"""

from __future__ import annotations

import json
import os
import sys
import time

import jax
import jax.numpy as jnp

from jaxinfer.cli.options import Parser
from jaxinfer.models.config import PRESETS
from jaxinfer.models.decoder import first_token_layer
from jaxinfer.models.spec import param_spec
from jaxinfer.quant import quantize


def comma_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def parser() -> Parser:
    p = Parser("bench_quantize.py", __doc__)
    p.option(None, "model", choices=sorted(PRESETS), default="llama3-8b", metavar="PRESET",
             help="Preset whose layer shapes are quantized [default: llama3-8b].")
    p.option(None, "schemes", type=comma_list,
             default=["int8", "int4-g32", "int4-g64", "int4-g128", "fp8"], metavar="SCHEME,SCHEME",
             help="Schemes to time [default: int8,int4-g32,int4-g64,int4-g128,fp8].")
    p.option(None, "out", default=os.path.join(os.environ.get("OUT", "results"), "quantize-time.json"),
             help="JSON results [default: $OUT/quantize-time.json, else results/].")
    return p


def main(argv: list[str]) -> None:
    F = parser().parse(argv)
    config = PRESETS[F.model]
    spec = param_spec(config).layer
    key = jax.random.PRNGKey(0)
    leaves = {k: jax.random.normal(jax.random.fold_in(key, i), s.shape, jnp.float32) / s.fan_in ** 0.5
              for i, (k, s) in enumerate(spec.items()) if s.quantizable}
    jax.block_until_ready(leaves)
    rows = []
    if any(scheme.startswith("int4") for scheme in F.schemes):
        layer = {k: leaves[k] if k in leaves else jnp.ones(s.shape, jnp.float32) for k, s in spec.items()}
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            jax.block_until_ready(first_token_layer(config, layer, 0, jnp.ones(config.hidden_size, jnp.float32)))
            times.append(time.perf_counter() - t0)
        del layer
        rows.append(dict(scheme="first_token", first_s=times[0], layer_s=times[1],
                         model_s=times[1] * config.num_layers))
        print(rows[-1], flush=True)
    for scheme in F.schemes:
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            for k, w in leaves.items():
                importance = (jnp.ones(w.shape if k == "wqkv" else w.shape[-1:], jnp.float32)
                              if scheme.startswith("int4") else None)
                jax.block_until_ready(quantize(w, scheme, importance))
            times.append(time.perf_counter() - t0)
        rows.append(dict(scheme=scheme, first_s=times[0], layer_s=times[1],
                         model_s=times[1] * config.num_layers))
        print(rows[-1], flush=True)
    result = dict(command=" ".join(["python"] + sys.argv), model=F.model,
                  shapes={k: list(w.shape) for k, w in leaves.items()},
                  device=f"{jax.devices()[0].device_kind} (jax {jax.__version__})", rows=rows)
    os.makedirs(os.path.dirname(F.out) or ".", exist_ok=True)
    with open(F.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\n{F.model}: one layer ({', '.join(f'{k} {tuple(w.shape)}' for k, w in leaves.items())})\n")
    print("| scheme | first layer s (with compile) | layer s | x num_layers s |")
    print("|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['scheme']} | {r['first_s']:.2f} | {r['layer_s']:.2f} | {r['model_s']:.0f} |")


if __name__ == "__main__":
    main(sys.argv[1:])

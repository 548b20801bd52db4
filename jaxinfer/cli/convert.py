"""Convert any model source (GGUF, HF safetensors directory, preset) to an orbax directory.

A later ``load_model(output)`` restores the arrays directly, skipping dequantization, transposes,
Q/K/V fusion and, with ``--quantization``, quantization itself (int4's grid search takes minutes a
billion parameters on a CPU): the engine then runs the weights as saved (its ``quantization="auto"``).
The tokenizer is saved alongside so the directory is self-contained.

  jaxinfer convert smollm2-135m --output /tmp/smollm2 --dtype bfloat16
  jaxinfer convert /path/to/hf-llama --output /tmp/llama-int4 --quantization int4-g64
  jaxinfer convert smollm2-135m --output /tmp/smollm2-q4 --quantization gguf
  jaxinfer convert Qwen/Qwen2.5-0.5B-Instruct --output /tmp/qwen-int8 --quantization int8
"""

import os
import sys
import time

from jaxinfer.cli import options
from jaxinfer.cli.options import Parser
from jaxinfer.formats import QUANTIZATIONS


def parser() -> Parser:
    p = Parser("jaxinfer convert", __doc__)
    options.add_model_argument(p, default=None)
    p.option(None, "output", required=True, help="Directory to write the orbax checkpoint to.")
    p.option(None, "dtype", default="float32", help="dtype of the saved float weights, e.g. float32 or bfloat16 "
             "[default: float32].")
    p.option(None, "quantization", choices=QUANTIZATIONS, default="none", help="Weights saved quantized: a scheme "
             "quantized now from the float weights (int8, int4[-gN], fp8), or gguf to keep a GGUF file's own "
             "blocks [default: none].")
    hub = p.add_argument_group("Hugging Face Hub")
    p.option(hub, "revision", default=None, help="Branch, tag or commit of a Hub id (default main).")
    p.option(hub, "download-dir", default=None, help="Cache directory Hub models are fetched into and found in.")
    p.option(hub, "gguf-file", default=None, help="The one .gguf file of a Hub repo or local directory to load.")
    return p


def main(argv: list[str]) -> None:
    args, model = options.parse_command(parser(), argv)
    from jaxinfer.models.weights import check_has_weights, load_model, resolve_model, save_converted

    try:
        source = resolve_model(model, revision=args.revision, download_dir=args.download_dir,
                               gguf_file=args.gguf_file)  # a Hub id is fetched into its cache now
        check_has_weights(source, "auto")
    except ValueError as e:
        sys.exit(f"jaxinfer convert: {e}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the rest reads local files; before transformers is imported
    import jax

    from jaxinfer.models.spec import num_params
    from jaxinfer.tokenizer import CONVERTED_TOKENIZER_DIR, load_tokenizer

    t0 = time.perf_counter()
    # Saved stacked ("scan"), the layout a restore can fill without a second copy.
    config, weights = load_model(source, dtype=args.dtype, layer_loop="scan", quantization=args.quantization)
    print(f"loaded {model} (quantization {args.quantization}) in {time.perf_counter() - t0:.1f} s")
    save_converted(weights, config, args.output)
    tokenizer = load_tokenizer(source)
    if tokenizer is not None:
        tokenizer.save_pretrained(os.path.join(args.output, CONVERTED_TOKENIZER_DIR))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(weights))
    print(f"wrote {args.output} ({num_params(config) / 1e6:.1f}M params, {args.dtype}, "
          f"quantization {args.quantization}, {nbytes / 1e6:.1f} MB of weights)")


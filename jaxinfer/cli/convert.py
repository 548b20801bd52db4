"""Convert any model source (GGUF, HF safetensors directory, preset) to an orbax directory.

A later ``load_model(output)`` restores the arrays directly, skipping dequantization, transposes,
Q/K/V fusion and, with ``--quantization``, quantization itself (int4's grid search takes minutes a
billion parameters on a CPU): the engine then runs the weights as saved (its ``quantization="auto"``).
The tokenizer is saved alongside so the directory is self-contained.

  jaxinfer convert --model smollm2-135m --output /tmp/smollm2 --dtype bfloat16
  jaxinfer convert --model /path/to/hf-llama --output /tmp/llama-int4 --quantization int4-g64
  jaxinfer convert --model smollm2-135m --output /tmp/smollm2-q4 --quantization gguf
  jaxinfer convert --model Qwen/Qwen2.5-0.5B-Instruct --output /tmp/qwen-int8 --quantization int8
"""

import os
import sys
import time

from absl import flags

from jaxinfer.formats import QUANTIZATIONS

MODEL = flags.DEFINE_string("model", None, "preset name, .gguf file, Hugging Face directory or Hugging Face Hub id "
                            "(org/name, org/name:file.gguf)", required=True)
OUTPUT = flags.DEFINE_string("output", None, "directory to write the orbax checkpoint to", required=True)
DTYPE = flags.DEFINE_string("dtype", "float32", "dtype of the saved float weights, e.g. float32 or bfloat16")
QUANTIZATION = flags.DEFINE_enum("quantization", "none", QUANTIZATIONS,
                                 "weights saved quantized: a scheme quantized now from the float weights "
                                 "(int8, int4[-gN], fp8), or 'gguf' to keep a GGUF file's own blocks")


def main(argv):
    del argv
    from jaxinfer.models.weights import check_has_weights, load_model, resolve_model, save_converted

    try:
        source = resolve_model(MODEL.value)  # a Hugging Face Hub id is fetched into its cache now
        check_has_weights(source, "auto")
    except ValueError as e:
        sys.exit(f"jaxinfer convert: {e}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the rest reads local files; before transformers is imported
    import jax

    from jaxinfer.models.spec import num_params
    from jaxinfer.tokenizer import CONVERTED_TOKENIZER_DIR, load_tokenizer

    t0 = time.perf_counter()
    # Saved stacked ("scan"), the layout a restore can fill without a second copy.
    config, weights = load_model(source, dtype=DTYPE.value, layer_loop="scan", quantization=QUANTIZATION.value)
    print(f"loaded {MODEL.value} (quantization {QUANTIZATION.value}) in {time.perf_counter() - t0:.1f} s")
    save_converted(weights, config, OUTPUT.value)
    tokenizer = load_tokenizer(source)
    if tokenizer is not None:
        tokenizer.save_pretrained(os.path.join(OUTPUT.value, CONVERTED_TOKENIZER_DIR))
    nbytes = sum(x.nbytes for x in jax.tree.leaves(weights))
    print(f"wrote {OUTPUT.value} ({num_params(config) / 1e6:.1f}M params, {DTYPE.value}, "
          f"quantization {QUANTIZATION.value}, {nbytes / 1e6:.1f} MB of weights)")


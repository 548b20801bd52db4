"""Convert any model source (GGUF, HF safetensors directory, preset) to an orbax directory.

A later ``load_model(output)`` restores the arrays directly, skipping dequantization, transposes and
Q/K/V fusion. The tokenizer is saved alongside so the directory is self-contained.

  python scripts/convert_checkpoint.py --model smollm2-135m --output /tmp/smollm2 --dtype bfloat16
"""

import os

from absl import app, flags

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from jaxinfer.models.weights import load_model, resolve_model, save_converted  # noqa: E402
from jaxinfer.tokenizer import CONVERTED_TOKENIZER_DIR, load_tokenizer  # noqa: E402

MODEL = flags.DEFINE_string("model", None, "preset name, .gguf file or Hugging Face directory", required=True)
OUTPUT = flags.DEFINE_string("output", None, "directory to write the orbax checkpoint to", required=True)
DTYPE = flags.DEFINE_string("dtype", "float32", "dtype of the saved weights, e.g. float32 or bfloat16")


def main(argv):
    del argv
    source = resolve_model(MODEL.value)
    # Saved stacked ("scan"), the layout a restore can fill without a second copy.
    config, weights = load_model(MODEL.value, dtype=DTYPE.value, layer_loop="scan")
    save_converted(weights, config, OUTPUT.value)
    tokenizer = load_tokenizer(source)
    if tokenizer is not None:
        tokenizer.save_pretrained(os.path.join(OUTPUT.value, CONVERTED_TOKENIZER_DIR))
    print(f"wrote {OUTPUT.value} ({config.num_params() / 1e6:.1f}M params, {DTYPE.value})")


if __name__ == "__main__":
    app.run(main)

"""Write a Hugging Face directory with a preset's shapes and SmolLM2's tokenizer, for --load_format dummy.

    python benchmarks/make_dummy_model.py --shapes llama3-8b --out /tmp/llama3-8b-smollm2tok
    jaxinfer serve --model /tmp/llama3-8b-smollm2tok --load_format dummy ...

A serving benchmark needs real text in and out (tokenize, detokenize, stop strings) but no real
weights; this pairs any preset's shapes (vocabulary cut to the tokenizer's) with SmolLM2's tokenizer
files. The weights file is an empty placeholder: only --load_format dummy can load the directory.
"""

from __future__ import annotations

import json
import os

from absl import app, flags

flags.DEFINE_string("shapes", "llama3-8b", "Preset whose shapes the model takes.")
flags.DEFINE_integer("num_layers", None, "Override the preset's layer count (e.g. 2 for a fast CPU model).")
flags.DEFINE_integer("hidden_size", None, "Override the preset's hidden size (with --num_heads and "
                     "--intermediate_size).")
flags.DEFINE_integer("num_heads", None, "Override the preset's attention heads (kv heads follow: min(kv, heads)).")
flags.DEFINE_integer("intermediate_size", None, "Override the preset's MLP size.")
flags.DEFINE_string("out", None, "Directory to write.", required=True)
F = flags.FLAGS


def main(argv):
    del argv
    from jaxinfer.models.config import PRESETS
    from jaxinfer.models.families import config_to_hf
    from jaxinfer.models.spec import num_params
    from jaxinfer.models.weights import resolve_model
    from jaxinfer.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model("smollm2-135m"))
    cfg = PRESETS[F.shapes].replace(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                    eos_token_ids=(tokenizer.eos_token_id,), tie_word_embeddings=False)
    if F.num_layers:
        cfg = cfg.replace(num_layers=F.num_layers)
    if F.hidden_size:
        heads = F.num_heads or cfg.num_heads
        cfg = cfg.replace(hidden_size=F.hidden_size, num_heads=heads, num_kv_heads=min(cfg.num_kv_heads, heads),
                          head_dim=F.hidden_size // heads, intermediate_size=F.intermediate_size or 4 * F.hidden_size)
    os.makedirs(F.out, exist_ok=True)
    with open(os.path.join(F.out, "config.json"), "w") as f:
        json.dump(config_to_hf(cfg), f, indent=2)
    tokenizer.save_pretrained(F.out)
    with open(os.path.join(F.out, "model.safetensors"), "wb") as f:  # an empty safetensors file: {} header
        f.write((2).to_bytes(8, "little") + b"{}")
    print(f"wrote {F.out}: {F.shapes} shapes ({num_params(cfg) / 1e6:.0f}M params), vocab {cfg.vocab_size}")


if __name__ == "__main__":
    app.run(main)

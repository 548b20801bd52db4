"""Write a Hugging Face directory with a preset's shapes and SmolLM2's tokenizer, for --load-format dummy.

    python benchmarks/make_dummy_model.py --shapes llama3-8b --out /tmp/llama3-8b-smollm2tok
    jaxinfer serve /tmp/llama3-8b-smollm2tok --load-format dummy ...

A serving benchmark needs real text in and out (tokenize, detokenize, stop strings) but no real
weights; this pairs any preset's shapes (vocabulary cut to the tokenizer's) with SmolLM2's tokenizer
files. The weights file is an empty placeholder: only --load-format dummy can load the directory.
"""

from __future__ import annotations

import json
import os
import sys

from jaxinfer.cli.options import Parser


def parser() -> Parser:
    p = Parser("make_dummy_model.py", __doc__)
    p.option(None, "shapes", default="llama3-8b", help="Preset whose shapes the model takes [default: llama3-8b].")
    p.option(None, "num-layers", type=int, default=None, help="Override the preset's layer count (e.g. 2 for a "
             "fast CPU model).")
    p.option(None, "hidden-size", type=int, default=None, help="Override the preset's hidden size (with "
             "--num-heads and --intermediate-size).")
    p.option(None, "num-heads", type=int, default=None, help="Override the preset's attention heads (kv heads "
             "follow: min(kv, heads)).")
    p.option(None, "intermediate-size", type=int, default=None, help="Override the preset's MLP size.")
    p.option(None, "out", required=True, help="Directory to write.")
    return p


def main(argv: list[str]) -> None:
    F = parser().parse(argv)
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
    main(sys.argv[1:])

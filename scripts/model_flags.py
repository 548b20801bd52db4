"""The flags that choose and load the model, shared by serve.py, generate.py and benchmark.py so that
each means, defaults to and is checked the same everywhere. Importing this module defines them; a
script adopts them (``flags.adopt_module_key_flags``) so that its ``--help`` lists them."""

from __future__ import annotations

from absl import flags

flags.DEFINE_string("model", "smollm2-135m", "Preset name (e.g. llama3-8b), local Hugging Face directory, "
                    "or .gguf file.")
flags.DEFINE_enum("load_format", "auto", ["auto", "dummy"], "'auto' reads the weights; 'dummy' uses random "
                  "ones of the same shapes.")
flags.DEFINE_enum("dtype", "auto", ["auto", "float32", "bfloat16"], "Weights and KV cache dtype (auto: "
                  "float32 on CPU, bfloat16 on accelerators).")
flags.DEFINE_string("compilation_cache_dir", None, "Persistent XLA compilation cache (default: "
                    "$XDG_CACHE_HOME/jaxinfer/xla; '' turns it off): later runs skip "
                    "recompiling.")

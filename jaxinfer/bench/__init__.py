"""What ``jaxinfer bench`` (``jaxinfer/cli/bench.py``) and the scripts in benchmarks/ measure with:
random prompts (``prompts``), the streaming load generator for an OpenAI-compatible server
(``client``), and the figures and tables of a run (``metrics``). Nothing here imports JAX."""

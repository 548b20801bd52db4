"""8 x (128 + 128) on the embedded model on CPU under two bucket sets, in one process, alternating
rounds: the server's defaults otherwise, prompts from the Apache LICENSE text, greedy. The 8-token
bucket (the second set, now the CPU default) won all 7 rounds on a 2-core CPU.
Both engines are run once first (compiling what the workload meets, through the default
compilation cache), and their greedy tokens compared.

    python scripts/bench_cpu_buckets.py 3            # rounds; prints output tok/s per engine and round
"""

import sys
import time

from benchmark import license_prompts  # scripts/ is on sys.path when run as a script
from jaxinfer import LLM, SamplingParams

CONFIGS = {"1/16/64/128, seqs 1/4/16": dict(token_buckets=(1, 16, 64, 128), seq_buckets=(1, 4, 16)),
           "1/8/16/64/128, seqs 1/4/8/16": dict(token_buckets=(1, 8, 16, 64, 128), seq_buckets=(1, 4, 8, 16))}


def main(rounds: int) -> None:
    llms = {k: LLM("smollm2-135m", max_num_seqs=16, max_num_batched_tokens=128, max_model_len=1024, **v)
            for k, v in CONFIGS.items()}
    prompts = license_prompts(next(iter(llms.values())).tokenizer, 8, 128)
    greedy = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    tokens = {k: [o.token_ids for o in llm.generate(prompts, greedy)] for k, llm in llms.items()}
    print("greedy tokens equal:", len({str(t) for t in tokens.values()}) == 1, flush=True)
    for r in range(rounds):
        for k, llm in llms.items():
            t = time.perf_counter()
            llm.generate(prompts, greedy)
            dt = time.perf_counter() - t
            print(f"round {r}: buckets {k}: {8 * 128 / dt:.1f} output tok/s ({dt:.1f} s)", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 3)

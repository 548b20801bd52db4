"""Chat with a model in the terminal: each line you type is a user turn, the reply streams as it is
generated, and the conversation is kept (the model's chat template renders all of it each turn, and
the prefix cache keeps what earlier turns computed). ``/reset`` starts over, ``/exit`` or end of input
(Ctrl-D) quits.

    jaxinfer chat                                  # the embedded SmolLM2-135M-Instruct
    jaxinfer chat Qwen/Qwen2.5-0.5B-Instruct --system "Answer briefly." --temperature 0
"""

from __future__ import annotations

import sys

from jaxinfer.cli import generate, options
from jaxinfer.cli.options import Parser


def parser() -> Parser:
    p = Parser("jaxinfer chat", __doc__)
    options.add_model_argument(p)
    g = p.add_argument_group("chat")
    p.option(g, "system", default=None, help="A system message opening the conversation.")
    generate.add_sampling_options(p, g)
    options.add_engine_options(p, defaults=generate.ENGINE_DEFAULTS)
    options.add_distributed_options(p)
    return p


def main(argv: list[str]) -> None:
    p = parser()
    args, model = options.parse_command(p, argv)
    params = generate.sampling_params(p, args)
    llm = generate.load(p, args, model, "jaxinfer chat")
    if llm is not None:
        converse(llm, params, args.system, sys.stdin, sys.stdout)


def converse(llm, params, system: str | None, lines, out) -> list[dict]:
    """Read user turns from ``lines`` until ``/exit`` or their end, streaming each reply to ``out``;
    returns the conversation."""
    from jaxinfer.tokenizer import apply_chat_template

    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    prompt = "> " if getattr(lines, "isatty", lambda: False)() else ""
    while True:
        out.write(prompt)
        out.flush()
        line = lines.readline()
        if not line or line.strip() == "/exit":
            return messages
        text = line.strip()
        if text == "/reset":
            messages = list(start)
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        try:
            ids = apply_chat_template(llm.tokenizer, messages)
        except ValueError as e:
            sys.exit(f"jaxinfer chat: {e}")
        if len(ids) >= llm.engine.max_model_len:
            out.write(f"[the conversation fills the context ({llm.engine.max_model_len} tokens): /reset]\n")
            messages.pop()
            continue
        reply = generate.stream(llm, ids, params, out)
        out.write("\n")
        messages.append({"role": "assistant", "content": reply})

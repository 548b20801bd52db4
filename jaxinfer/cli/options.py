"""The command line's options, made from the engine's own description of them (``EngineConfig``'s fields
and ``batching.config.OPTIONS``), so a new engine option is a flag of ``jaxinfer serve`` with no copy to
keep in step. Shared by every subcommand and by the benchmarks that run the server.

Spelling: each flag has vLLM's name where vLLM names the option otherwise (``--tensor-parallel-size``
for ``tensor_parallel``, ``--gpu-memory-utilization`` for ``kv_cache_memory_fraction``), the field's
own name too, and each with dashes or underscores (``--max-num-seqs``, ``--max_num_seqs``). Booleans
are ``--x`` / ``--no-x`` (or ``--x=false``); bucket lists are comma-separated.

Where a value comes from, last wins: the option's default, a ``JAXINFER_<DEST>`` environment variable
(``JAXINFER_MAX_NUM_SEQS=64``), a ``--config file.yaml`` (keys are flag names, either spelling), the
command line. Nothing here imports JAX, so ``--help`` answers at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import typing

from jaxinfer.batching.config import _CHOICES, OPTIONS, SPECULATIVE_METHODS, EngineConfig

ENV_PREFIX = "JAXINFER_"
# Read from the environment by their own code, with its own precedence (the API key: --api-key_file
# and $JAXINFER_API_KEY are alternatives, not layers).
_NOT_FROM_ENV = frozenset({"api_key"})
# vLLM's --speculative-config keys, as EngineConfig fields (method "draft_model" is vLLM's "draft").
_SPECULATIVE_KEYS = {"method": "speculative_method", "model": "speculative_model",
                     "num_speculative_tokens": "num_speculative_tokens", "prompt_lookup_min": "ngram_min",
                     "prompt_lookup_max": "ngram_max", "disable_by_batch_size": "speculative_max_num_seqs"}


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` shows each option's dashed spellings only (every one also takes underscores)."""

    def _format_action_invocation(self, action):
        if not action.option_strings:
            return super()._format_action_invocation(action)
        shown = [s for s in action.option_strings if "_" not in s] or action.option_strings
        return super()._format_action_invocation(argparse.Action(shown, action.dest, nargs=action.nargs,
                                                                 metavar=action.metavar, choices=action.choices))

    def _format_usage(self, usage, actions, groups, prefix):  # the options are listed below it
        text = super()._format_usage(usage, [a for a in actions if not a.option_strings], groups, prefix)
        return text.replace(self._prog, f"{self._prog} [options]", 1)


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (``prog: error: ...``) and whose option names may
    be spelled with dashes or underscores; ``parse`` layers the environment and ``--config`` under the
    command line."""

    def __init__(self, prog: str, description: str | None = None, **kw):
        super().__init__(prog=prog, description=description, allow_abbrev=False,
                         formatter_class=_Formatter, **kw)
        self.add_argument("--config", metavar="FILE.yaml", help="Options from a YAML file (keys: flag names); "
                          "the command line overrides them, they override $JAXINFER_<NAME> variables.")

    def option(self, group, *names: str, **kw) -> argparse.Action:
        """An option spelled ``names`` (first the one ``--help`` shows), each with dashes and underscores."""
        strings = []
        for name in names:
            for spelling in (name.replace("_", "-"), name.replace("-", "_")):
                if f"--{spelling}" not in strings:
                    strings.append(f"--{spelling}")
        return (group or self).add_argument(*strings, **kw)

    def flag(self, group, *names: str, default: bool | None, help: str, dest: str | None = None) -> None:
        """A boolean: ``--name`` (or ``--name=true|false``, and ``none`` where the default is None: the
        engine decides) and ``--no-name``."""
        dest = dest or names[0].replace("-", "_")
        self.option(group, *names, dest=dest, nargs="?", const=True, default=default,
                    type=_bool if default is not None else _or_none(_bool),
                    metavar="BOOL", help=help + ("" if default is None else f" [default: {default}]"))
        self.option(group, *(f"no-{n}" for n in names), dest=dest, action="store_false",
                    help=argparse.SUPPRESS)

    def parse(self, argv: list[str]) -> argparse.Namespace:
        """``argv`` parsed over the defaults the environment and ``--config`` give."""
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--config")
        known, _ = pre.parse_known_args(argv)
        actions = {a.dest: a for a in self._actions if a.option_strings and a.dest not in ("help", "config")
                   and a.help is not argparse.SUPPRESS}
        layered = {}
        for dest, action in actions.items():
            value = os.environ.get(ENV_PREFIX + dest.upper())
            if value is not None and dest not in _NOT_FROM_ENV:
                layered[dest] = self._converted(action, value, f"${ENV_PREFIX}{dest.upper()}")
        if known.config:
            names = {s.lstrip("-").replace("-", "_"): a.dest for a in actions.values() for s in a.option_strings}
            for key, value in _read_yaml(self, known.config).items():
                dest = names.get(str(key).replace("-", "_"))
                if dest is None:
                    self.error(f"{known.config}: unknown option {key!r}")
                layered[dest] = self._converted(actions[dest], value, f"{known.config}: {key}")
        self.set_defaults(**layered)
        return self.parse_args(argv)

    def _converted(self, action: argparse.Action, value, where: str):
        if isinstance(value, list):
            value = ",".join(map(str, value))
        if action.type is None or not isinstance(value, str):
            return value
        try:
            out = action.type(value)
        except (argparse.ArgumentTypeError, ValueError) as e:
            self.error(f"{where}: {e}")
        if action.choices is not None and out not in action.choices:
            self.error(f"{where}: {out!r} is not one of {', '.join(map(str, action.choices))}")
        return out


def add_engine_options(parser: Parser, *, defaults: dict | None = None, exclude: tuple[str, ...] = ()) -> None:
    """A flag for every ``EngineConfig`` field but ``exclude`` (``defaults``: the command's own, else the
    config's), and vLLM's ``--speculative-config``; ``engine_config`` reads them back."""
    group = parser.add_argument_group("engine options (LLM(...)'s; jaxinfer.batching.config.OPTIONS)")
    hints = typing.get_type_hints(EngineConfig)
    fields = {f.name: f for f in dataclasses.fields(EngineConfig)}
    defaults = defaults or {}
    for name, opt in OPTIONS.items():
        if name in exclude:
            continue
        default = defaults.get(name, fields[name].default)
        names = (opt.vllm, name) if opt.vllm else (name,)
        kind = _base_type(hints[name])
        optional = type(None) in typing.get_args(hints[name])
        if kind is bool:
            parser.flag(group, *names, dest=name, default=default, help=opt.help)
            continue
        kw = dict(dest=name, default=default, help=opt.help + ("" if default is None else f" [default: {default}]"))
        if name in _CHOICES:
            kw["choices"] = _CHOICES[name]
        elif name == "speculative_method":
            kw["choices"] = SPECULATIVE_METHODS
        if kind is tuple:
            kw.update(type=_int_list, metavar="N,N,...")
        else:
            kw.update(type=kind, metavar=kind.__name__.upper() if "choices" not in kw else None)
        if optional:  # "none": the engine derives it (what leaving the option out of LLM(...) does)
            kw["type"] = _or_none(kw["type"])
            if "choices" in kw:
                kw["choices"] = (*kw["choices"], None)
        parser.option(group, *names, **kw)
    if "speculative_method" not in exclude:
        parser.option(group, "speculative-config", type=json.loads, default=None, metavar="JSON",
                      help="vLLM's speculative decoding settings as JSON: method (ngram, draft_model), model, "
                           "num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, disable_by_batch_size "
                           "(the same as the separate flags, which it overrides).")


def engine_config(parser: Parser, args: argparse.Namespace, **fixed) -> EngineConfig:
    """The ``EngineConfig`` the parsed flags (and ``fixed`` options) describe; a bad value exits with
    one line naming it."""
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    options = {name: value for name, value in vars(args).items() if name in names}
    spec = getattr(args, "speculative_config", None)
    if spec is not None:
        if not isinstance(spec, dict):
            parser.error("--speculative-config must be a JSON object")
        unknown = sorted(set(spec) - set(_SPECULATIVE_KEYS))
        if unknown:
            parser.error(f"--speculative-config: unknown keys {unknown}; allowed: {sorted(_SPECULATIVE_KEYS)}")
        for key, value in spec.items():
            options[_SPECULATIVE_KEYS[key]] = "draft" if key == "method" and value == "draft_model" else value
        if "model" in spec and "method" not in spec:
            options["speculative_method"] = "draft"
    options.update(fixed)
    try:
        return EngineConfig(**options)
    except (TypeError, ValueError) as e:
        parser.error(str(e))


def command_line(config: EngineConfig) -> list[str]:
    """``config`` as flags of ``jaxinfer serve``, every option (the server's defaults differ from
    ``LLM(...)``'s), so a benchmark's server runs exactly the engine its offline peer builds."""
    args = []
    for f in dataclasses.fields(EngineConfig):
        value = getattr(config, f.name)
        if value is None:
            value = "none"
        elif isinstance(value, tuple):
            value = ",".join(map(str, value))
        args.append(f"--{f.name}={str(value).lower() if isinstance(value, bool) else value}")
    return args


def add_model_argument(parser: Parser, default: str | None = "smollm2-135m") -> None:
    """The model, positional (``jaxinfer serve org/name``, as ``vllm serve``) or ``--model``."""
    what = ("Hugging Face Hub id (org/name, or org/name:file.gguf for one GGUF file of a repo; fetched into the "
            "Hugging Face cache; HF_HUB_OFFLINE=1: the cache only; HF_TOKEN: gated and private repos), local "
            "Hugging Face directory, .gguf file, or preset name (e.g. llama3-8b: shapes only, with "
            "--load-format dummy)")
    parser.add_argument("model_arg", nargs="?", metavar="MODEL", help=f"The model: {what}.")
    parser.option(None, "model", default=None, help=f"The model, as MODEL [default: {default}].")
    parser.set_defaults(model_default=default)


def parse_command(parser: Parser, argv: list[str]) -> tuple[argparse.Namespace, str]:
    """``argv`` parsed (``Parser.parse``), and the model it names (``model_of``)."""
    args = parser.parse(argv)
    return args, model_of(parser, args)


def model_of(parser: Parser, args: argparse.Namespace) -> str:
    """The model the flags name: the positional one or ``--model`` (both only if the same)."""
    if args.model_arg is not None and args.model is not None and args.model_arg != args.model:
        parser.error(f"two models given, {args.model_arg!r} and --model={args.model!r}: give one")
    model = args.model_arg or args.model or args.model_default
    if model is None:
        parser.error("give a model (MODEL or --model)")
    return model


def add_distributed_options(parser: Parser) -> None:
    group = parser.add_argument_group("several processes or hosts (jax.distributed)")
    parser.option(group, "coordinator-address", default=None, metavar="HOST:PORT",
                  help="Process 0's address; every process passes the same flags but its --process-id.")
    parser.option(group, "num-processes", type=int, default=1, help="Processes of the run [default: 1].")
    parser.option(group, "process-id", type=int, default=0,
                  help="This process's index in [0, --num-processes); 0 runs the scheduler [default: 0].")


def init_distributed(args: argparse.Namespace) -> bool:
    """Join the multi-process run the flags describe (before anything touches a device); returns
    whether this process is a follower, which runs the steps process 0 sends instead of the command
    (see ``jaxinfer.batching.multihost``)."""
    if args.coordinator_address is None:
        return False
    from jaxinfer.batching.multihost import initialize

    initialize(args.coordinator_address, args.num_processes, args.process_id)
    return args.process_id != 0


def fetch_model(prog: str, model: str, config: EngineConfig) -> None:
    """Resolve ``model`` (and ``--tokenizer``) as the engine will, before anything else loads: a Hub id
    is fetched into the Hugging Face cache now (with its progress bars), so the engine finds it there;
    a model that cannot be loaded exits with the one line that says why."""
    from jaxinfer.models.weights import check_has_weights, resolve_model
    from jaxinfer.tokenizer import check_has_tokenizer, tokenizer_source

    try:
        source = resolve_model(model, revision=config.revision, download_dir=config.download_dir,
                               gguf_file=config.gguf_file)
        check_has_weights(source, config.load_format)
        tokenizer = tokenizer_source(source, config)
        if tokenizer is not None:
            check_has_tokenizer(tokenizer)
    except ValueError as e:
        sys.exit(f"{prog}: {e}")


def _base_type(hint):
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    base = args[0] if args else hint
    return typing.get_origin(base) or base


def _or_none(convert):
    """``convert``, except that "none" is None."""

    def converted(text):
        return None if isinstance(text, str) and text.strip().lower() == "none" else convert(text)

    converted.__name__ = getattr(convert, "__name__", "value")  # argparse names it in its errors
    return converted


def _bool(text: str) -> bool:
    if isinstance(text, bool):
        return text
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in str(text).split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _read_yaml(parser: Parser, path: str) -> dict:
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        parser.error(f"--config {path}: {e}")
    if not isinstance(data, dict):
        parser.error(f"--config {path}: expected a mapping of option names to values")
    return data

"""The command line: flags made from EngineConfig in vLLM's spellings, the layers a value comes from
(default, environment, --config file, command line), one-line errors, and a --help that starts no JAX."""

import dataclasses
import subprocess
import sys

import pytest

from jaxinfer.batching.config import OPTIONS, EngineConfig
from jaxinfer.cli import options, serve


def parsed(argv, **env):
    p = serve.parser()
    return p, p.parse(argv)


def config(argv) -> EngineConfig:
    p, args = parsed(argv)
    return options.engine_config(p, args)


def test_every_engine_option_is_a_flag_in_vllms_spelling_and_ours():
    help_text = serve.parser().format_help()
    for name, opt in OPTIONS.items():
        assert f"--{(opt.vllm or name).replace('_', '-')}" in help_text, name
    assert set(OPTIONS) == {f.name for f in dataclasses.fields(EngineConfig)}
    spellings = [["--tensor-parallel-size", "2"], ["--tensor_parallel_size=2"], ["--tensor-parallel", "2"],
                 ["--tensor_parallel=2"]]
    assert {config(argv).tensor_parallel for argv in spellings} == {2}
    c = config(["org/name", "--max-num-seqs", "7", "--max_num_batched_tokens=64", "--gpu-memory-utilization", "0.5",
                "--no-enable-prefix-caching", "--block-size", "32", "--token-buckets", "8,64"])
    assert (c.max_num_seqs, c.max_num_batched_tokens, c.kv_cache_memory_fraction) == (7, 64, 0.5)
    assert (c.enable_prefix_caching, c.page_size, c.token_buckets) == (False, 32, (8, 64))
    assert config(["--enable_prefix_caching=false"]).enable_prefix_caching is False
    # the server's own defaults where they differ from LLM(...)'s
    assert (config([]).max_num_seqs, EngineConfig().max_num_seqs) == (serve.ENGINE_DEFAULTS["max_num_seqs"], 32)


def test_speculative_config_json():
    c = config(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}'])
    assert (c.speculative_method, c.num_speculative_tokens, c.ngram_max) == ("ngram", 3, 5)
    c = config(["--speculative_config", '{"model": "smollm2-135m"}'])
    assert (c.speculative_method, c.speculative_model) == ("draft", "smollm2-135m")


def test_layers_default_env_config_file_command_line(tmp_path, monkeypatch):
    path = tmp_path / "serve.yaml"
    path.write_text("max-num-seqs: 5\nmax_model_len: 512\nenable-prefix-caching: false\nport: 9001\n"
                    "token_buckets: [8, 32]\n")
    monkeypatch.setenv("JAXINFER_MAX_NUM_SEQS", "3")
    monkeypatch.setenv("JAXINFER_PAGE_SIZE", "8")
    p, args = parsed(["--config", str(path), "--max-model-len", "256"])
    c = options.engine_config(p, args)
    assert c.page_size == 8  # environment
    assert (c.max_num_seqs, c.enable_prefix_caching, c.token_buckets, args.port) == (5, False, (8, 32), 9001)  # file
    assert c.max_model_len == 256  # command line


def test_model_positional_or_flag():
    def model(argv):
        p, args = parsed(argv)
        return options.model_of(p, args)

    assert model([]) == "smollm2-135m"
    assert model(["org/name"]) == model(["--model", "org/name"]) == model(["org/name", "--model=org/name"])
    with pytest.raises(SystemExit):
        model(["org/a", "--model", "org/b"])


@pytest.mark.parametrize("argv, words", [
    (["--max-num-seqs", "many"], "invalid int value"),
    (["--max-num-seqs", "0"], "max_num_seqs must be a positive integer"),
    (["--kv-cache-dtype", "int3"], "invalid choice"),
    (["--max-num-sequences", "4"], "unrecognized arguments"),
    (["a/b", "c/d"], "unrecognized arguments"),
    (["--speculative-config", '{"methd": "ngram"}'], "unknown keys ['methd']"),
])
def test_bad_flags_exit_with_one_line(argv, words, capsys):
    with pytest.raises(SystemExit) as e:
        config(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("jaxinfer serve: error:") and words in err[-1], err


def test_bad_environment_and_config_values_name_their_source(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JAXINFER_MAX_NUM_SEQS", "lots")
    with pytest.raises(SystemExit):
        parsed([])
    assert "$JAXINFER_MAX_NUM_SEQS" in capsys.readouterr().err
    monkeypatch.delenv("JAXINFER_MAX_NUM_SEQS")
    path = tmp_path / "bad.yaml"
    path.write_text("max_num_sequences: 4\n")
    with pytest.raises(SystemExit):
        parsed(["--config", str(path)])
    assert "unknown option 'max_num_sequences'" in capsys.readouterr().err


def test_command_line_round_trip():
    """A benchmark launches the server with ``command_line(config)``: the server builds the same config."""
    want = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=256, enable_prefix_caching=False,
                        token_buckets=(8, 32), kv_cache_dtype="int8", speculative_method="ngram", ngram_max=3)
    p = serve.parser()
    assert options.engine_config(p, p.parse(options.command_line(want))) == want
    assert options.engine_config(p, p.parse(options.command_line(EngineConfig()))) == EngineConfig()


def test_help_lists_the_options_without_starting_jax():
    code = ("import sys; from jaxinfer.cli import main; sys.argv = ['jaxinfer', 'serve', '--help']\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\nassert 'jax' not in sys.modules, 'jax imported'")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--max-num-seqs" in out.stdout and "--gpu-memory-utilization" in out.stdout


def test_chat_keeps_the_conversation_and_streams_each_reply(tiny_chat_model):
    """``jaxinfer chat``'s loop: each line a user turn, the reply streamed and kept, ``/reset`` starting
    over; a reply equals ``LLM.chat`` of the same conversation (greedy)."""
    import io

    from jaxinfer import LLM, SamplingParams
    from jaxinfer.cli import chat

    llm = LLM(tiny_chat_model, load_format="dummy", dtype="float32", max_model_len=256, max_num_seqs=1,
              max_num_batched_tokens=64,
              token_buckets=(8, 64), seq_buckets=(1,), page_buckets=(16,))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    out = io.StringIO()
    messages = chat.converse(llm, params, "Be brief.", io.StringIO("hi\nhow are you?\n/reset\nbye\n"), out)
    assert [m["role"] for m in messages] == ["system", "user", "assistant"] and messages[1]["content"] == "bye"
    want = llm.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                    params)[0].outputs[0].text
    assert out.getvalue().startswith(want + "\n")
    assert messages[2]["content"] in out.getvalue()

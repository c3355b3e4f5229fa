"""External engines as data (slotune/tuner/spec/engines.py): the built-in llama-server file, launch
command lines, refused combinations, bad engine files, and flags checked against `--help`."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from slotune.tuner.spec.engines import EngineDescription, builtin_engines, load_engine, parse_help
from slotune.tuner.spec.yaml_reader import SpecError

# The layout llama.cpp's `common_arg::to_string` prints: names and value hint from column 0, help
# from column 40, continuation lines indented by 40.
LLAMA_HELP = """\
----- common params -----

-h,    --help, --usage                  print usage and exit
-t,    --threads N                      number of CPU threads to use during generation (default: -1)
                                        (env: LLAMA_ARG_THREADS)
-c,    --ctx-size N                     size of the prompt context (default: 4096, 0 = loaded from model)
-fa,   --flash-attn [on|off|auto]       set Flash Attention use ('on', 'off', or 'auto', default: 'auto')
                                        (env: LLAMA_ARG_FLASH_ATTN)
-ctk,  --cache-type-k TYPE              KV cache data type for K
                                        allowed values: f32, f16, bf16, q8_0, q4_0, q4_1, iq4_nl, q5_0, q5_1
                                        (default: f16)
-np,   --parallel N                     number of server slots (default: -1, -1 = auto)
--spec-ngram-mod-n-match N              ngram-mod lookup length (default: 24)
--spec-type none,draft-simple,ngram-simple,ngram-mod
                                        comma-separated list of types of speculative decoding to use (default:
                                        none)
--draft, --draft-n, --draft-max N       the argument has been removed. use --spec-draft-n-max or
                                        --spec-ngram-mod-n-max
-m,    --model FNAME                    model path to load

----- sampling params -----

These options are deprecated in favour of the server's own.
--samplers SAMPLERS                     samplers that will be used for generation
"""

ARGPARSE_HELP = """\
options:
  -h, --help            show this help message and exit
  --kv-cache-dtype {auto,fp8,fp8_e4m3}
                        Data type for kv cache storage.
  --max-num-seqs MAX_NUM_SEQS
                        Maximum number of sequences per iteration.
"""


def _toy(knobs: dict, *, binary: str = "toy", command: list[str]) -> EngineDescription:
    return EngineDescription.model_validate({"name": "toy", "binary": binary, "command": command, "knobs": knobs})


def test_the_builtin_llama_server_renders_a_launch():
    e = load_engine("llama-server")
    assert "llama-server" in builtin_engines()
    argv = e.argv(
        {"threads": 2, "parallel": 4, "ctx_per_slot": 1024, "cache_type_v": "q8_0", "flash_attn": "on"},
        binary="/opt/llama-server",
        model="m.gguf",
        port=8123,
    )
    assert argv[:7] == ["/opt/llama-server", "--model", "m.gguf", "--host", "127.0.0.1", "--port", "8123"]
    flags = dict(zip(argv[10::2], argv[11::2]))
    assert flags == {
        "--threads": "2",
        "--parallel": "4",
        "--ctx-size": "4096",  # parallel * ctx_per_slot: each slot gets its own context
        "--cache-type-v": "q8_0",
        "--flash-attn": "on",
    }


def test_a_derived_flag_is_left_off_until_its_knobs_are_set():
    argv = load_engine("llama-server").argv({"parallel": 4}, binary="b", model="m", port=1)
    assert "--ctx-size" not in argv and argv[-2:] == ["--parallel", "4"]


def test_values_the_engine_would_refuse_are_named():
    e = load_engine("llama-server")
    problems = e.check_values({"cache_type_v": "q4_0", "flash_attn": "off", "parallel": 0, "bogus": 1, "threads": "2"})
    assert "'bogus' is not a knob of llama-server" in problems
    assert "parallel: 0 is below 1" in problems
    assert "threads: '2' is not a whole number" in problems
    assert any("quantized V cache needs flash attention" in p for p in problems)
    assert e.check_values({"cache_type_v": "q4_0", "flash_attn": "auto"}) == []  # auto turns it on
    assert e.check_values({"cache_type_v": "q4_0"}) == []  # and auto is llama.cpp's default
    assert e.check_values({"ctx_size": 4096}) == ["ctx_size is set from parallel * ctx_per_slot: set those instead"]
    with pytest.raises(ValueError, match="quantized V cache"):
        e.argv({"cache_type_v": "q8_0", "flash_attn": "off"}, binary="b", model="m", port=1)


def test_bool_knobs_render_as_a_switch_or_as_a_value():
    e = _toy(
        {
            "mlock": {"flag": "--mlock", "type": "bool"},
            "fa": {"flag": "-fa", "type": "bool", "bool_values": ["on", "off"]},
        },
        command=["{binary}", "--port", "{port}"],
    )
    assert e.argv({"mlock": True, "fa": False}, binary="toy", model="m", port=9)[3:] == ["--mlock", "-fa", "off"]
    assert e.argv({"mlock": False}, binary="toy", model="m", port=9)[3:] == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"command": ["{binary}", "--port", "{prot}"]}, "unknown placeholder {prot}"),
        ({"knobs": {"n": {"flag": "-n", "type": "int", "value": "slots * 2"}}}, "names 'slots'"),
        ({"knobs": {"n": {"flag": "-n", "type": "int", "value": "n.__class__"}}}, "only knob names"),
        ({"knobs": {"n": {"flag": "-n", "type": "choice"}}}, "needs `choices`"),
        ({"knobs": {"n": {"flag": "n", "type": "int"}}}, "flag"),
        ({"rules": [{"when": {"x": [1]}, "require": {"n": [1]}, "reason": "r"}]}, "rules[0].when: x"),
        ({"knobs": {"n": {"flag": "-n", "type": "int"}}, "extra": 1}, "extra"),
    ],
)
def test_a_bad_engine_file_is_refused_naming_what_to_fix(tmp_path, change, message):
    raw = {"name": "toy", "binary": "toy", "command": ["{binary}"], "knobs": {"n": {"flag": "-n", "type": "int"}}}
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump({**raw, **change}))
    with pytest.raises(SpecError, match=message.replace("[", r"\[").replace("{", r"\{")):
        load_engine(path)


def test_an_unknown_builtin_engine_lists_the_builtin_ones():
    with pytest.raises(SpecError, match="no built-in engine 'vllm'; built in: llama-server"):
        load_engine("vllm")


def test_help_texts_are_read_with_their_allowed_values():
    flags = parse_help(LLAMA_HELP)
    assert flags["--flash-attn"].allowed == ["on", "off", "auto"] and flags["-fa"].allowed == ["on", "off", "auto"]
    assert "q4_0" in flags["--cache-type-k"].allowed and "q8_0" in flags["-ctk"].allowed
    assert flags["--spec-type"].allowed == ["none", "draft-simple", "ngram-simple", "ngram-mod"]
    assert flags["--threads"].allowed == [] and "--spec-ngram-mod-n-match" in flags and "--usage" in flags
    assert "--default" not in flags and "LLAMA_ARG_THREADS" not in flags
    assert "deprecated" not in flags["--model"].text  # a section's own text is no option's help
    assert flags["--draft-max"].text.startswith("the argument has been removed. use --spec-draft-n-max or --spec")
    flags = parse_help(ARGPARSE_HELP)
    assert flags["--kv-cache-dtype"].allowed == ["auto", "fp8", "fp8_e4m3"] and "--max-num-seqs" in flags


def test_flags_and_choices_the_binary_lacks_are_named():
    e = _toy(
        {
            "threads": {"flag": "--threads", "type": "int"},
            "slots": {"flag": "--n-slots", "type": "int"},  # renamed: llama.cpp says --parallel
            "ctk": {"flag": "--cache-type-k", "type": "choice", "choices": ["f16", "q3_k"]},
            "draft": {"flag": "--draft-max", "type": "int"},  # still listed, but removed
        },
        binary="llama-server",
        command=["{binary}", "--model", "{model}"],
    )
    problems = e.help_problems(LLAMA_HELP)
    assert len(problems) == 3
    assert problems[0].startswith("draft: `llama-server` lists --draft-max as gone: the argument has been removed")
    assert "slots: `llama-server` does not know --n-slots" in problems[1]
    assert "ctk: --cache-type-k does not accept q3_k" in problems[2]


@pytest.mark.skipif(shutil.which("llama-server") is None, reason="needs llama.cpp's llama-server on PATH")
def test_every_flag_of_the_builtin_file_is_known_to_the_real_llama_server():
    """The real binary's --help, as `tune validate` reads it."""
    e = load_engine("llama-server")
    text = subprocess.run(["llama-server", *e.help], capture_output=True, text=True, timeout=60).stdout
    assert e.help_problems(text) == []

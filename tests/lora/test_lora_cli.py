"""`--lora NAME=PATH` and `--max-lora-rank` on the command line; an adapter that cannot be
served stops `everystop serve` with one line naming the reason, before any port is bound."""

from __future__ import annotations

import pytest

from everystop.cli import build_parser
from everystop.engine.args import config_or_exit, engine_config_from_args
from everystop.server.cli import serve


def _args(*flags: str):
    argv = ["serve", *flags]
    return build_parser(argv).parse_args(argv)


def test_lora_flags_reach_the_model_config():
    config = engine_config_from_args(_args("--lora", "a=/x", "--lora", "b = /y",
                                           "--max-lora-rank", "16", "--max-cpu-loras", "3"))
    assert config.model.lora_modules == (("a", "/x"), ("b", "/y"))
    assert config.model.max_lora_rank == 16
    assert config.model.max_cpu_loras == 3


def test_a_lora_flag_without_a_path_is_refused(capsys):
    with pytest.raises(SystemExit):
        _args("--lora", "just-a-name")
    assert "expected NAME=PATH" in capsys.readouterr().err


def test_an_adapter_above_the_rank_limit_stops_the_server_by_name(lora_dirs, capsys):
    base, adapters = lora_dirs
    args = _args("--model", base, "--dtype", "float32", "--lora", f"kod={adapters['kod']}",
                 "--max-lora-rank", "8", "--num-gpu-blocks", "16", "--port", "1")
    assert serve(args) == 2
    err = capsys.readouterr().err
    assert "cannot start" in err and "rank 16 is above the maximum LoRA rank 8" in err


def test_lora_with_tensor_parallelism_is_refused_at_start_up_by_name(capsys):
    for flags in (("--lora", "a=/x"), ("--enable-lora",)):
        with pytest.raises(SystemExit) as exit_:
            config_or_exit(_args(*flags, "--tensor-parallel-size", "2"))
        assert exit_.value.code == 2
        err = capsys.readouterr().err
        assert "LoRA adapters (--lora, --enable-lora) are not served with " \
               "--tensor-parallel-size > 1" in err
    assert engine_config_from_args(_args("--lora", "a=/x")).parallel.tensor_parallel_size == 1

"""Logging: the start-up summary through the `nanovllm` logger, the default stderr handler (and
when nanovllm leaves logging alone), the progress bar over weight shards, and the CLI's --log-level."""
import logging
import os
import subprocess
import sys

import pytest

from nanovllm import LLM
from nanovllm.cli import build_parser
from nanovllm.utils.tiny_model import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
MAX_LEN = 40  # 3 blocks of 16 tokens per full-length sequence


def run_python(code: str, env: dict | None = None, **kwargs) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**ENV, **(env or {})}, **kwargs)
    assert out.returncode == 0, out.stderr
    return out


def info_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("INFO ")]


def test_start_up_summary_is_logged_once_at_info(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="nanovllm"), LLM(model_dir, max_model_len=MAX_LEN, max_num_seqs=3) as llm:
        num_blocks = llm.stats()["num_blocks"]
    records = [r for r in caplog.records if r.name.startswith("nanovllm.") and r.levelno == logging.INFO]
    text = "\n".join(r.getMessage() for r in records)
    num_tokens = num_blocks * 16
    assert f"KV cache: {num_blocks} blocks x 16 tokens = {num_tokens} tokens" in text, text
    assert text.count("Maximum concurrency") == 1, text
    assert f"Maximum concurrency for {MAX_LEN} tokens per request: {num_tokens / MAX_LEN:.2f}x" in text, text
    assert "Qwen3ForCausalLM, dtype float32, device cpu, attention backend torch" in text, text
    assert "CUDA graphs: off" in text and "Loading weights" in text, text


SCENARIO = """
import logging, sys
{setup}
import nanovllm
assert not logging.getLogger("nanovllm").handlers, "importing nanovllm must configure nothing"
nanovllm.LLM({path!r}, max_model_len=40, max_num_seqs=2).shutdown()
log = logging.getLogger("nanovllm")
print(len(log.handlers), log.propagate)
"""


@pytest.mark.parametrize("case", ["default", "opt-out", "application configured"])
def test_default_handler_only_where_the_application_configured_none(model_dir, case):
    setup = "logging.basicConfig(level=logging.INFO, format='APP %(message)s')" if case == "application configured" else ""
    env = {"NANOVLLM_CONFIGURE_LOGGING": "0"} if case == "opt-out" else {}
    out = run_python(SCENARIO.format(setup=setup, path=model_dir), env)
    summaries = [line for line in out.stderr.splitlines() if "Maximum concurrency" in line]
    if case == "default":  # our handler, in vLLM's format, and not propagated (no second copy)
        assert out.stdout.split() == ["1", "False"]
        assert len(summaries) == 1 and summaries[0].startswith("INFO ") and "[llm_engine.py:" in summaries[0]
    elif case == "opt-out":  # no handler: INFO goes nowhere (Python's last resort prints WARNING and up)
        assert out.stdout.split() == ["0", "True"] and not summaries, out.stderr
    else:  # through the application's handler, once
        assert out.stdout.split() == ["0", "True"]
        assert len(summaries) == 1 and summaries[0].startswith("APP Maximum concurrency"), out.stderr


def test_shard_progress_bar_shows_only_when_loading_takes_a_while(model_dir, capsys, caplog, monkeypatch):
    with caplog.at_level(logging.INFO, logger="nanovllm"):
        LLM(model_dir, max_model_len=MAX_LEN, max_num_seqs=2).shutdown()  # a tiny model: loaded at once
        assert "Loading safetensors shards" not in capsys.readouterr().err
        monkeypatch.setattr("nanovllm.utils.logging.PROGRESS_DELAY_S", 0)  # as if it took longer than the delay
        LLM(model_dir, max_model_len=MAX_LEN, max_num_seqs=2).shutdown()
        assert "Loading safetensors shards: 100%" in capsys.readouterr().err


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return build_model(str(tmp_path_factory.mktemp("chat")), chat_template=True, max_position_embeddings=64)


def run_chat(model: str, *flags: str) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "nanovllm", "chat", model, "--max-model-len", "64", *flags],
                         input="/exit\n", capture_output=True, text=True, timeout=120, env=ENV)
    assert out.returncode == 0, out.stderr
    return out


def test_chat_log_goes_to_stderr_at_the_chosen_level(chat_model):
    default = run_chat(chat_model)
    assert any("Maximum concurrency" in line for line in info_lines(default.stderr)), default.stderr
    assert "INFO" not in default.stdout, default.stdout  # the chat's own output stays clean
    quiet = run_chat(chat_model, "--log-level", "warning")
    assert not info_lines(quiet.stderr), quiet.stderr


def test_cli_logging_flags():
    parser = build_parser()
    serve = parser.parse_args(["serve", "m"])
    assert serve.log_level == "info" and serve.disable_log_requests is False
    assert parser.parse_args(["serve", "m", "--disable-log-requests"]).disable_log_requests is True
    assert parser.parse_args(["chat", "m", "--log-level", "debug"]).log_level == "debug"

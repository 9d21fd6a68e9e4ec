"""Models by Hugging Face Hub repository id: LLM("org/name") and `nanovllm serve org/name` resolve
the id through huggingface_hub (here offline, from a Hub cache this test fills in the cache's own
layout), a local folder works as before, and a name that is neither is a ValueError naming it."""
import os
import shutil
import subprocess
import sys

import pytest

from nanovllm.utils.tiny_model import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = "tiny-org/tiny-qwen3"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory):
    """A Hub cache holding REPO at COMMIT: models--org--name/{refs/main, snapshots/COMMIT/<files>}."""
    cache = tmp_path_factory.mktemp("hub")
    repo = cache / ("models--" + REPO.replace("/", "--"))
    build_model(str(repo / "snapshots" / COMMIT))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return str(cache)


def run(code: str, hub_cache: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_CACHE": hub_cache, "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "NANOVLLM_CONFIGURE_LOGGING": "0"}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_a_repository_id_loads_from_the_hub_cache(hub_cache, tmp_path):
    local = str(tmp_path / "local")
    shutil.copytree(os.path.join(hub_cache, "models--" + REPO.replace("/", "--"), "snapshots", COMMIT), local)
    code = f"""
from nanovllm import LLM, SamplingParams
params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
by_id = LLM({REPO!r}, max_model_len=64)
assert by_id.config.model.endswith({COMMIT!r}), by_id.config.model
by_folder = LLM({local!r}, max_model_len=64)
a, b = (llm.generate(["The quick brown fox"], params, use_tqdm=False)[0] for llm in (by_id, by_folder))
assert a["token_ids"] == b["token_ids"] and a["text"] == b["text"], (a, b)
print("ok")
"""
    result = run(code, hub_cache)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


def test_serve_takes_a_repository_id(hub_cache):
    code = f"""
from nanovllm.cli import build_parser
from nanovllm.entrypoints.args import llm_from_args
args = build_parser().parse_args(["serve", {REPO!r}, "--max-model-len", "64"])
with llm_from_args(args) as llm:
    assert llm.config.model.endswith({COMMIT!r})
print("ok")
"""
    result = run(code, hub_cache)
    assert result.returncode == 0 and "ok" in result.stdout, result.stderr


def test_a_name_that_is_neither_is_a_value_error(hub_cache):
    code = """
from nanovllm import LLM
for name in ("nobody/nothing-here", "not a name!"):
    try:
        LLM(name)
    except ValueError as e:
        print("ValueError:", e)
"""
    result = run(code, hub_cache)
    lines = [line for line in result.stdout.splitlines() if line.startswith("ValueError")]
    assert len(lines) == 2, result.stderr
    assert "'nobody/nothing-here'" in lines[0] and "Hugging Face Hub" in lines[0]
    assert "'not a name!'" in lines[1] and "does not exist" in lines[1]

import os
import random
import sys

import pytest
import torch

# Under pytest-xdist (README's `-n auto`), each worker gets its share of the cores, and so does every
# process a test spawns (tensor-parallel ranks, servers: OMP_NUM_THREADS is inherited). torch's
# intra-op threads spin-wait, so two workers of all the cores each ran the suite no faster than one
# process did (1,137 s against 1,120 s on 2 cores); a core each took it to 602 s.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    _share = max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_share)
    torch.set_num_threads(_share)

sys.path.insert(0, os.path.dirname(__file__))
from hf_reference import hf_greedy  # noqa: E402

from nanovllm.utils.tiny_model import build_model  # noqa: E402



@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """Qwen3, GQA (4 query heads over 2 KV heads), untied embeddings, with a tokenizer."""
    return build_model(str(tmp_path_factory.mktemp("qwen3")))


@pytest.fixture(scope="session")
def tied_model_dir(tmp_path_factory):
    """Qwen3 with tied embeddings and plain multi-head attention (4 KV heads)."""
    return build_model(str(tmp_path_factory.mktemp("qwen3_tied")), seed=1, tie_word_embeddings=True,
                       num_key_value_heads=4)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """tiny_models(table, name): the folder of table[name] = (arch, seed, build_model overrides),
    built on first use."""
    built = {}

    def get(table, name):
        if name not in built:
            arch, seed, overrides = table[name]
            built[name] = build_model(str(tmp_path_factory.mktemp(name)), arch=arch, seed=seed, **overrides)
        return built[name]
    return get


@pytest.fixture(scope="session")
def prompts():
    """8 random prompts, 1 to 300 tokens long."""
    rng = random.Random(0)
    return [[rng.randrange(1, 512) for _ in range(n)] for n in (1, 7, 16, 33, 80, 150, 257, 300)]


_REFERENCE = {}


@pytest.fixture(scope="session")
def reference():
    """reference(path, prompt, n): Hugging Face's greedy completion, memoized across tests."""
    def get(path, prompt, n):
        key = (path, tuple(prompt), n)
        if key not in _REFERENCE:
            _REFERENCE[key] = hf_greedy(path, list(prompt), n)
        return _REFERENCE[key]
    return get


@pytest.fixture
def fake_flash_attn(monkeypatch):
    """flash-attn's interface, computed by PyTorch (tests/fake_flash_attn): (the module, our backend)."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(__file__), "fake_flash_attn"))
    import flash_attn
    from nanovllm.layers.backends.flash_attn import FlashAttnBackend
    flash_attn.CALLS.clear()
    yield flash_attn, FlashAttnBackend
    for name in ("flash_attn", "nanovllm.layers.backends.flash_attn"):
        sys.modules.pop(name, None)

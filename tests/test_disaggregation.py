"""Prefill/decode disaggregation (distributed/disaggregation.py): a prefill engine and a decode engine,
each a process, the decode engine pulling each prompt's K/V over torch.distributed (gloo here): the
output is a colocated engine's, token for token, with the prompt's full blocks served from the pull."""
import os
import subprocess
import sys

import pytest

from nanovllm import LLM, SamplingParams
from nanovllm.distributed.disaggregation import DisaggregatedLLM
from nanovllm.utils.tiny_model import build_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OPTIONS = {"device": "cpu", "dtype": "float32", "max_model_len": 512}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_model(str(tmp_path_factory.mktemp("disagg")))


def test_disaggregated_output_is_colocated_and_the_prefix_comes_from_the_prefill_engine(model):
    base = list(range(3, 103))
    prompts = [[7, 8, 9, 10, 11],  # (no full block: straight to the decode engine)
               list(range(40, 57)),  # 17 tokens: one full block, then the last token
               list(range(60, 93)),  # 33: two blocks
               base, base[:90] + [1, 2, 3],  # a prefix in common: the second's first blocks are cached already
               [5] * 300]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with LLM(model, **OPTIONS) as llm:
        expected = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    with DisaggregatedLLM(model, OPTIONS) as llm:
        outputs = llm.generate(prompts, params)
        with pytest.raises(ValueError, match="exceeds max_model_len=512"):
            llm.submit([1] * 510, params)
        with pytest.raises(TypeError, match="list of token ids"):
            llm.submit("text", params)
        processes = llm.processes
    assert [o["token_ids"] for o in outputs] == expected
    # every full block before the last token was pulled (or, for the shared prefix, was there already)
    assert [o["num_cached_tokens"] for o in outputs] == [(len(p) - 1) // 16 * 16 for p in prompts]
    assert all(o["metrics"]["ttft_s"] > 0 for o in outputs)
    assert not [p for p in processes if p.is_alive()]


def test_the_demo_checks_the_outputs_and_prints_both_latencies():
    out = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "disagg_demo.py"), "--num-decodes", "3",
                          "--decode-tokens", "48", "--num-long", "2", "--long-len", "200"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "tokens identical: True" in out.stdout
    for kind in ("decode", "long"):
        for where in ("colocated", "disaggregated"):
            assert f"{kind}  {where}:" in out.stdout and "TPOT p50" in out.stdout, out.stdout
    assert "took 384 prompt tokens' K/V from the prefill engine" in out.stdout, out.stdout  # (2 x 192)

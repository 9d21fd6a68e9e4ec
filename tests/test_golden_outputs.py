"""Outputs recorded before a rewrite of the step path, and checked after it: greedy and seeded
sampling (every sampling control), n > 1, logprobs, stop strings and ids, with overlap
scheduling on and off, under preemption, chunked prefill and small blocks. A change to the engine
that changes any token for a given seed fails here.

    python tests/test_golden_outputs.py --record   # rewrite tests/golden_outputs.json (only on purpose)

The model's weights come from our own seeded generator, parameter by parameter in name order, so
that they do not depend on how a transformers release initializes a model; the file records their
fingerprint, and a different one (another torch build's generator, say) is reported as such.
"""
import json
import os
import sys
import tempfile

import pytest
import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from nanovllm import LLM, SamplingParams  # noqa: E402
from nanovllm.utils.tiny_model import build_model  # noqa: E402

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden_outputs.json")
MAX_MODEL_LEN = 160
LOGPROB_TOLERANCE = 1e-4  # float32 rounding of a batch whose composition differs between loops

PARAMS = [
    dict(temperature=0, max_tokens=24, ignore_eos=True),
    dict(temperature=0.8, top_p=0.9, top_k=20, seed=1, max_tokens=17),
    dict(temperature=1.0, min_p=0.05, seed=2, max_tokens=30, n=2, logprobs=3),
    dict(temperature=0.7, seed=3, max_tokens=20, repetition_penalty=1.3, presence_penalty=0.5,
         frequency_penalty=0.2, min_tokens=5),
    dict(temperature=0, max_tokens=40, stop=["st9", "zz"], include_stop_str_in_output=True),
    dict(temperature=1.0, seed=4, max_tokens=25, stop_token_ids=[317, 500]),
    dict(temperature=1.2, top_k=5, seed=5, max_tokens=20, n=3),
    dict(temperature=0, max_tokens=12, logprobs=2, repetition_penalty=1.5),
    dict(temperature=0.9, top_p=0.5, seed=6, max_tokens=33, stop=["tion", "ab"]),
    dict(temperature=1.0, seed=7, max_tokens=18, frequency_penalty=1.5, min_p=0.1, top_p=0.95),
]
OPTIONS = {
    "plain": {},
    "preemption": {"num_kvcache_blocks": 14, "kvcache_block_size": 16},
    "chunked": {"max_num_batched_tokens": 40},
    "few_seqs": {"max_num_seqs": 3, "kvcache_block_size": 4},
}


def build_golden_model(path: str) -> str:
    """The tiny Qwen3 of the tests, with weights drawn by our own generator (see the docstring)."""
    build_model(path, seed=0)
    file = os.path.join(path, "model.safetensors")
    weights = load_file(file)
    gen = torch.Generator().manual_seed(1234)
    for name in sorted(weights):
        shape = weights[name].shape
        if "norm" in name:
            weights[name] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            weights[name] = 0.2 * torch.randn(shape, generator=gen)
    save_file(weights, file)
    return path


def fingerprint(path: str) -> float:
    weights = load_file(os.path.join(path, "model.safetensors"))
    return round(sum(float(w.double().abs().sum()) for w in weights.values()), 6)


def prompts() -> list:
    shared = list(range(40, 90))  # the prompts share 50 tokens: prefix-cache hits
    return [shared + [i] * (i + 1) for i in range(len(PARAMS))] + ["Hello world", "a b c d e"]


def run(path: str, options: dict, async_scheduling: bool) -> list[dict]:
    params = [SamplingParams(**p) for p in PARAMS] + [SamplingParams(**PARAMS[1]), SamplingParams(**PARAMS[2])]
    llm = LLM(path, max_model_len=MAX_MODEL_LEN, async_scheduling=async_scheduling, **options)
    outputs = llm.generate(prompts(), params, use_tqdm=False)
    stats = llm.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"], "blocks leaked"
    assert (stats["num_preemptions"] > 0) == ("num_kvcache_blocks" in options), "preemption, where it is the case"
    llm.shutdown()
    return [[{"token_ids": s["token_ids"], "text": s["text"], "finish_reason": s["finish_reason"],
              "stop_reason": s["stop_reason"],
              "logprobs": [{str(k): round(v, 6) for k, v in d.items()} for d in s["logprobs"]]
              if "logprobs" in s else None}
             for s in out.get("samples", [out])] for out in outputs]


@pytest.fixture(scope="module")
def golden_model(tmp_path_factory):
    return build_golden_model(str(tmp_path_factory.mktemp("golden")))


@pytest.fixture(scope="module")
def golden():
    with open(GOLDEN) as f:
        return json.load(f)


def test_the_golden_model_is_the_one_recorded(golden_model, golden):
    assert fingerprint(golden_model) == golden["fingerprint"], \
        "the golden model's weights differ from the recorded ones: this environment draws other numbers"


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["overlapped", "synchronous"])
@pytest.mark.parametrize("case", list(OPTIONS))
def test_outputs_equal_the_recorded_ones(golden_model, golden, case, async_scheduling):
    got, want = run(golden_model, OPTIONS[case], async_scheduling), golden["outputs"][case]
    assert len(got) == len(want)
    for i, (samples, recorded) in enumerate(zip(got, want)):
        for j, (s, r) in enumerate(zip(samples, recorded, strict=True)):
            where = f"{case}, request {i}, sample {j}"
            assert {k: s[k] for k in ("token_ids", "text", "finish_reason", "stop_reason")} == \
                {k: r[k] for k in ("token_ids", "text", "finish_reason", "stop_reason")}, where
            assert (s["logprobs"] is None) == (r["logprobs"] is None), where
            for d, e in zip(s["logprobs"] or [], r["logprobs"] or [], strict=True):
                assert d.keys() == e.keys() and all(abs(d[k] - e[k]) < LOGPROB_TOLERANCE for k in d), where


def record():
    with tempfile.TemporaryDirectory() as tmp:
        path = build_golden_model(tmp)
        outputs = {}
        for case, options in OPTIONS.items():
            outputs[case] = run(path, options, async_scheduling=False)
        data = {"fingerprint": fingerprint(path), "outputs": outputs}
    with open(GOLDEN, "w") as f:  # one sample a line
        f.write('{"fingerprint": %s, "outputs": {\n' % json.dumps(data["fingerprint"]))
        f.write(",\n".join(f"{json.dumps(case)}: [\n" + ",\n".join(
            "[" + ", ".join(json.dumps(s) for s in samples) + "]" for samples in outs) + "]"
            for case, outs in data["outputs"].items()))
        f.write("}}\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit(__doc__)
    record()

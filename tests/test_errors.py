"""Bad input raises a clear ValueError/TypeError and leaves the engine usable."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from nanovllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir, max_model_len=200)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(temperature=-0.1), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(top_k=0), ValueError, "top_k"),
    (dict(top_k=-2), ValueError, "top_k"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(max_tokens=0), ValueError, "max_tokens"),
    (dict(max_tokens=2.5), TypeError, "max_tokens"),
    (dict(seed=-1), ValueError, "seed"),
    (dict(ignore_eos="yes"), TypeError, "ignore_eos"),
    (dict(min_p=1.5), ValueError, "min_p"),
    (dict(presence_penalty=2.5), ValueError, "presence_penalty"),
    (dict(frequency_penalty=-3), ValueError, "frequency_penalty"),
    (dict(repetition_penalty=0), ValueError, "repetition_penalty"),
    (dict(n=0), ValueError, "n must be"),
    (dict(logprobs=-1), ValueError, "logprobs"),
    (dict(min_tokens=10, max_tokens=5), ValueError, "min_tokens"),
    (dict(stop=[""]), ValueError, "stop"),
    (dict(stop=5), ValueError, "stop"),
    (dict(stop_token_ids=[-3]), ValueError, "stop_token_ids"),
    (dict(include_stop_str_in_output=1), TypeError, "include_stop_str_in_output"),
    (dict(skip_special_tokens="no"), TypeError, "skip_special_tokens must be a bool"),
])
def test_bad_sampling_params(kwargs, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("prompt, error, match", [
    ([], ValueError, "at least one token"),
    ("", ValueError, "at least one token"),
    ([1, 2, 512], ValueError, "outside the vocabulary"),
    ([1, -1], ValueError, "outside the vocabulary"),
    ([1] * 195, ValueError, "max_model_len"),
    ([1.0, 2.0], TypeError, "prompt"),
    (None, TypeError, "prompt"),
])
def test_bad_prompts_leave_engine_usable(llm, prompt, error, match):
    good = [3, 4, 5]
    expected = llm.generate([good], GREEDY, use_tqdm=False)[0]["token_ids"]
    with pytest.raises(error, match=match):
        llm.generate([good, prompt], GREEDY, use_tqdm=False)  # the good request is not queued either
    assert not llm.scheduler.waiting and not llm.scheduler.running
    assert llm.generate([good], GREEDY, use_tqdm=False)[0]["token_ids"] == expected
    assert llm.stats()["num_free_blocks"] == llm.stats()["num_blocks"]


def test_stop_strings_need_a_tokenizer(tmp_path):
    from nanovllm.utils.tiny_model import build_model
    llm = LLM(build_model(str(tmp_path / "m"), tokenizer=False), max_model_len=64)
    with pytest.raises(ValueError, match="stop needs a tokenizer"):
        llm.generate([[1, 2]], SamplingParams(stop=["x"], max_tokens=8), use_tqdm=False)


def test_bad_generate_arguments(llm):
    with pytest.raises(ValueError, match="2 sampling_params for 1 prompts"):
        llm.generate([[1, 2]], [GREEDY, GREEDY], use_tqdm=False)
    with pytest.raises(TypeError, match="SamplingParams"):
        llm.generate([[1, 2]], {"temperature": 0}, use_tqdm=False)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(no_such_option=1), TypeError, "no_such_option"),
    (dict(max_num_seqs=0), ValueError, "max_num_seqs"),
    (dict(max_model_len=-5), ValueError, "max_model_len"),
    (dict(kvcache_block_size=0), ValueError, "kvcache_block_size"),
    (dict(gpu_memory_utilization=1.5), ValueError, "gpu_memory_utilization"),
    (dict(dtype="int8"), ValueError, "dtype"),
    (dict(device="tpu"), ValueError, "device"),
    (dict(attention_backend="magic"), ValueError, "attention_backend"),
    (dict(load_format="pickle"), ValueError, "load_format"),
    (dict(enforce_eager="no"), TypeError, "enforce_eager"),
    # 10 blocks of 16 tokens cannot hold one sequence of 200 tokens
    (dict(num_kvcache_blocks=10, max_model_len=200), ValueError, "max_model_len=200"),
])
def test_bad_llm_options(model_dir, kwargs, error, match):
    with pytest.raises(error, match=match):
        LLM(model_dir, **kwargs)


def test_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        LLM(str(tmp_path / "nowhere"))


def test_unsupported_architecture(model_dir, tmp_path):
    folder = tmp_path / "other"
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["FancyNewForCausalLM"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported model architecture 'FancyNewForCausalLM'.*Qwen3ForCausalLM"):
        LLM(str(folder))


def test_missing_weights(model_dir, tmp_path):
    folder = tmp_path / "noweights"
    shutil.copytree(model_dir, folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="safetensors"):
        LLM(str(folder))
    llm = LLM(str(folder), load_format="dummy", max_model_len=64)  # random weights need no files
    assert len(llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]["token_ids"]) == 8


def test_checkpoint_with_unknown_tensors(model_dir, tmp_path):
    """A tensor the model has no parameter for (say, a bias config.json does not mention) must not be
    dropped silently."""
    from safetensors.torch import load_file, save_file
    folder = tmp_path / "extra"
    shutil.copytree(model_dir, folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.layers.0.self_attn.o_proj.bias"] = weights["model.norm.weight"].clone()
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="o_proj.bias"):
        LLM(str(folder), max_model_len=64)


def test_request_values_beyond_the_vocabulary_are_refused_up_front(llm):
    """logprobs above the vocabulary size used to fail mid-step in torch.topk, taking the other
    requests of the call with it; a stop token id beyond it, with min_tokens, in index_put."""
    good = [3, 4, 5]
    expected = llm.generate([good], GREEDY, use_tqdm=False)[0]["token_ids"]
    for params, match in [(SamplingParams(logprobs=600, max_tokens=4), "logprobs=600 exceeds .* 512"),
                          (SamplingParams(stop_token_ids=[512], min_tokens=2, max_tokens=4), "stop_token_ids has 512")]:
        with pytest.raises(ValueError, match=match):
            llm.generate([good, good], [GREEDY, params], use_tqdm=False)
        assert not llm.scheduler.waiting and not llm.scheduler.running
    assert llm.generate([good], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=512),
                        use_tqdm=False)[0]["token_ids"] == expected


@pytest.mark.parametrize("field, value", [("stop", ["ti"]), ("n", 0), ("max_tokens", 0), ("temperature", -1.0)])
def test_sampling_params_are_immutable(field, value):
    params = SamplingParams()
    with pytest.raises(AttributeError, match=field):
        setattr(params, field, value)


def test_sampling_params_keep_no_reference_to_caller_lists():
    stop, ids = ["a"], [1]
    params = SamplingParams(stop=stop, stop_token_ids=ids)
    stop.append("b")
    ids.append(2)
    assert params.stop == ("a",) and params.stop_token_ids == (1,)
    import dataclasses
    assert dataclasses.replace(params, n=2).n == 2
    with pytest.raises(ValueError, match="n must be"):
        dataclasses.replace(params, n=0)


def test_integer_like_token_ids(llm):
    """Tokenizers return numpy integers; they are token ids like ints. Other element types are
    named in the error."""
    import numpy as np
    good = [3, 4, 5]
    expected = llm.generate([good], GREEDY, use_tqdm=False)[0]["token_ids"]
    assert llm.generate([list(np.array(good, dtype=np.int64))], GREEDY, use_tqdm=False)[0]["token_ids"] == expected
    assert llm.generate(list(np.array(good, dtype=np.int32)), GREEDY, use_tqdm=False)[0]["token_ids"] == expected
    params = SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[np.int64(expected[3])])
    assert llm.generate([good], params, use_tqdm=False)[0]["token_ids"] == expected[:4]
    with pytest.raises(TypeError, match="got 2.5 of type float"):
        llm.generate([[1, 2.5]], GREEDY, use_tqdm=False)
    with pytest.raises(TypeError, match="of type bool"):
        llm.generate([[1, True]], GREEDY, use_tqdm=False)


def test_architectures_as_a_string(model_dir, tmp_path):
    folder = tmp_path / "arch_str"
    shutil.copytree(model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = "Qwen3ForCausalLM"
    (folder / "config.json").write_text(json.dumps(config))
    assert LLM(str(folder), max_model_len=64).generate([[1, 2]], GREEDY, use_tqdm=False)[0]["finish_reason"] == "length"
    config["architectures"] = "FancyNewForCausalLM"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model architecture 'FancyNewForCausalLM'"):
        LLM(str(folder))


def test_broken_generation_config(model_dir, tmp_path):
    folder = tmp_path / "gen_config"
    shutil.copytree(model_dir, folder)
    for text, match in [("{oops", "generation_config.json"), ('{"eos_token_id": "x"}', "eos_token_id")]:
        (folder / "generation_config.json").write_text(text)
        with pytest.raises(ValueError, match=match):
            LLM(str(folder), max_model_len=64)


def run_fresh_python(code: str) -> str:
    """Run `code` in a new interpreter (Triton's mode is fixed per process, so each case needs its
    own), without TRITON_INTERPRET (test modules of this session may have set it); its stdout."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([REPO_ROOT, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_triton_on_cpu_and_on_cuda_in_one_process_is_refused():
    """The Triton backend on CPU puts the process's Triton in interpreter mode: a later CUDA
    engine's Triton kernels (attention, fused MoE) would run interpreted, so it is refused, and
    the other way round. Neither side needs a GPU to be asked."""
    out = run_fresh_python("""
        from nanovllm.layers.backends import get_backend
        from nanovllm.utils.triton_mode import import_kernels
        get_backend("triton", "cpu")
        from nanovllm.layers.backends import triton_attn
        assert type(triton_attn._decode_kernel).__name__ == "InterpretedFunction"
        assert get_backend("triton", "cpu") is triton_attn.TritonBackend   # the same mode again: fine
        for ask in (lambda: get_backend("triton", "cuda"),
                    lambda: import_kernels("nanovllm.layers.moe_triton", "cuda", "the fused MoE kernel")):
            try:
                ask()
            except ValueError as e:
                print("refused:", e)
    """)
    refusals = out.splitlines()
    assert len(refusals) == 2, out
    for line in refusals:
        assert "device='cuda'" in line and "TRITON_INTERPRET='1'" in line and "interpreter" in line
    assert "attention_backend='triton'" in refusals[0] and "fused MoE" in refusals[1]
    out = run_fresh_python("""
        import torch
        from nanovllm.layers.backends import get_backend
        torch.cuda.is_available = lambda: True    # as on a GPU machine: the CUDA engine comes first
        get_backend("triton", "cuda")
        try:
            get_backend("triton", "cpu")
        except ValueError as e:
            print("refused:", e)
    """)
    assert "refused:" in out and "device='cpu'" in out and "compiled" in out, out

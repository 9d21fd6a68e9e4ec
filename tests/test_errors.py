"""Bad input raises a clear ValueError/TypeError and leaves the engine usable."""
import json
import shutil

import pytest

from nanovllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


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
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
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

"""Sleep and wake (features/sleep_mode.py, issue 50): sleep(level=1) gives back the KV cache's
memory (the process's resident memory drops by at least its size on CPU) and the output after
wake_up is the output before; sleep(level=2) drops the weights too (resident memory drops by them
as well), and an update while asleep, then wake_up, equals the new model; a request while asleep
is a RuntimeError at once; the state pools of Qwen3.5 and tensor parallelism's ranks sleep and wake
alike."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from nanovllm import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
MODELS = {"qwen3_a": ("qwen3", 0, {}), "qwen3_b": ("qwen3", 1, {}), "qwen3_5": ("qwen3_5", 0, {})}
# Enough blocks for a KV cache of a few hundred MB: the tiny Qwen3 (2 layers, K and V of 2 heads of
# 16, float32) keeps 512 bytes a token, 8 KiB a block of 16: 40,000 of them are 313 MiB
BIG_CACHE_BLOCKS = 40_000


def resident_bytes() -> int:
    """This process's resident memory now (Linux's /proc: VmRSS)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def outputs(llm, prompts):
    return [o["token_ids"] for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def test_level_1_frees_the_kv_cache_and_wakes_to_the_same_output(tiny_models, prompts, reference):
    a = tiny_models(MODELS, "qwen3_a")
    with LLM(a, max_model_len=400, num_kvcache_blocks=BIG_CACHE_BLOCKS) as llm:
        before = outputs(llm, prompts[:5])
        kv_bytes = llm.model_runner.kv_cache.nbytes
        assert kv_bytes > 300 * 2**20
        awake = resident_bytes()
        llm.sleep(level=1)
        asleep = resident_bytes()
        assert awake - asleep >= 0.98 * kv_bytes, (awake, asleep, kv_bytes)
        assert llm.asleep == 1
        llm.wake_up()
        assert resident_bytes() - asleep >= 0.98 * kv_bytes  # (the cache is back: touched by its zeroing)
        again = llm.generate(prompts[:5], GREEDY, use_tqdm=False)
    assert [o["token_ids"] for o in again] == before == [reference(a, p, 12) for p in prompts[:5]]
    assert all(o["num_cached_tokens"] == 0 for o in again)  # (the KV before the sleep is gone)


def test_level_2_drops_the_weights_and_an_update_while_asleep_gives_the_new_model(tiny_models, prompts, reference):
    a, b = tiny_models(MODELS, "qwen3_a"), tiny_models(MODELS, "qwen3_b")
    tensors = AutoModelForCausalLM.from_pretrained(b, dtype=torch.float32).state_dict()
    with LLM(a, max_model_len=400) as llm:
        weights = sum(p.untyped_storage().nbytes() for p in llm.model_runner.model.parameters())
        llm.sleep(level=2)
        assert sum(p.untyped_storage().nbytes() for p in llm.model_runner.model.parameters()) == 0 < weights
        llm.update_weights(tensors)
        with pytest.raises(RuntimeError, match="asleep"):  # (the weights are back, the KV cache is not)
            llm.generate(prompts[:1], GREEDY, use_tqdm=False)
        llm.wake_up()
        assert outputs(llm, prompts[:5]) == [reference(b, p, 12) for p in prompts[:5]]
        llm.sleep(level=2)  # a wake-up with no update: the checkpoint's weights again
        llm.wake_up(tags=["weights"])
        llm.wake_up(tags=["kv_cache"])
        assert llm.asleep == 0
        assert outputs(llm, prompts[:3]) == [reference(a, p, 12) for p in prompts[:3]]


def test_level_2_gives_back_the_weights_memory(tmp_path):
    """A model of ~130 MB of weights: resident memory drops by them at level 2."""
    from nanovllm.utils.tiny_model import build_model
    path = build_model(str(tmp_path / "wide"), hidden_size=512, intermediate_size=4096, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=64)
    with LLM(path, max_model_len=128, num_kvcache_blocks=64) as llm:
        weights = sum(s.nbytes() for s in {p.untyped_storage().data_ptr(): p.untyped_storage()
                                           for p in llm.model_runner.model.parameters()}.values())
        assert weights > 100 * 2**20
        awake = resident_bytes()
        llm.sleep(level=2)
        assert awake - resident_bytes() >= 0.95 * weights


def test_a_request_while_asleep_is_an_error_at_once_and_bad_calls_are_refused(tiny_models, prompts):
    a = tiny_models(MODELS, "qwen3_a")
    with LLM(a, max_model_len=400) as llm:
        with pytest.raises(ValueError, match="level must be 1"):
            llm.sleep(level=3)
        with pytest.raises(ValueError, match="level must be 1"):
            llm.sleep(level=True)
        llm.wake_up()  # (awake: nothing to do)
        stream = llm.stream(prompts[:2], GREEDY)  # validated now, queued at the first next()
        seqs = llm.add_request(prompts[1], GREEDY)
        with pytest.raises(ValueError, match="requests are in flight"):
            llm.sleep()
        while not llm.is_finished():
            llm.step()
        llm.sleep()
        with pytest.raises(ValueError, match="asleep already"):
            llm.sleep(level=2)
        with pytest.raises(RuntimeError, match=r"asleep \(sleep\(level=1\)\): call wake_up\(\) first"):
            llm.generate(prompts[:2], GREEDY, use_tqdm=False)
        with pytest.raises(RuntimeError, match="asleep"):
            next(stream)
        with pytest.raises(ValueError, match="tags must be"):
            llm.wake_up(tags=["weights", "everything"])
        assert llm.is_finished() and seqs[0].is_finished
        llm.wake_up()
        assert len(outputs(llm, prompts[:2])) == 2


def test_qwen3_5s_state_pools_sleep_and_wake(tiny_models, prompts, reference):
    """The conv and recurrent state pools are freed and zeroed at wake-up: a new sequence starts from zeros."""
    path = tiny_models(MODELS, "qwen3_5")
    with LLM(path, max_model_len=400, max_num_batched_tokens=64) as llm:
        before = outputs(llm, prompts[2:6])
        runner = llm.model_runner
        llm.sleep(level=1)
        assert runner.conv_states.untyped_storage().nbytes() == runner.ssm_states.untyped_storage().nbytes() == 0
        llm.wake_up()
        assert outputs(llm, prompts[2:6]) == before == [reference(path, p, 12) for p in prompts[2:6]]


def test_tensor_parallel_ranks_sleep_and_wake(tiny_models, prompts, reference):
    a, b = tiny_models(MODELS, "qwen3_a"), tiny_models(MODELS, "qwen3_b")
    with LLM(a, tensor_parallel_size=2, max_model_len=400) as llm:
        before = outputs(llm, prompts[:4])
        llm.sleep(level=2)
        llm.update_weights_from_disk(b)
        llm.wake_up()
        assert outputs(llm, prompts[:4]) == [reference(b, p, 12) for p in prompts[:4]]
        llm.sleep(level=1)
        llm.wake_up()
        assert outputs(llm, prompts[:4]) == [reference(b, p, 12) for p in prompts[:4]]
        llm.sleep(level=2)
        llm.wake_up()  # (every rank reloads its shard of A)
        assert outputs(llm, prompts[:4]) == before == [reference(a, p, 12) for p in prompts[:4]]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_sleep_frees_the_device_memory_and_the_graphs_are_captured_again(tiny_models, prompts):
    """Level 1 frees the KV cache and the weights' device memory (their bytes in host copies), and the
    CUDA graphs, captured over the old addresses, are captured again at wake-up: the output after
    equals the output before, bitwise the same tokens; level 2 reloads the checkpoint."""
    a = tiny_models(MODELS, "qwen3_a")
    with LLM(a, max_model_len=400, num_kvcache_blocks=4096, attention_backend="triton") as llm:
        runner = llm.model_runner
        before = outputs(llm, prompts[:6])
        graphs = runner.graphs
        assert graphs is not None
        freed = runner.kv_cache.nbytes + sum(p.untyped_storage().nbytes() for p in runner.model.parameters())
        torch.cuda.synchronize()
        used = torch.cuda.memory_allocated()
        llm.sleep(level=1)
        assert used - torch.cuda.memory_allocated() >= 0.99 * freed and runner.graphs is None
        llm.wake_up()
        assert runner.graphs is not None and runner.graphs is not graphs
        assert outputs(llm, prompts[:6]) == before
        llm.sleep(level=2)
        llm.wake_up()
        assert outputs(llm, prompts[:6]) == before

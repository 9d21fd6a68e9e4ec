"""Pipeline parallelism on CPU (gloo): the decoder layers over 2 or 3 stages, alone or with TP=2
in each, give Hugging Face's greedy tokens; each stage holds and sizes only its layers; steps are
cut into micro-batches; the stages' timing; bad options; no process left behind."""
import os

import numpy as np
import pytest

from hf_reference import assert_greedy_matches_hf, assert_matches_hf_with_caching_chunking_and_preemption
from nanovllm import LLM, SamplingParams
from nanovllm.distributed.pipeline import stage_layout, stage_times, time_stages
from nanovllm.distributed.stages import (head_cost_in_layers, layers_of_stage, num_micro_batches, split_batch,
                                         stage_busy)
from nanovllm.engine.step_batch import StepBatch
from nanovllm.utils.tiny_model import build_model
from test_tensor_parallel import assert_mixed_workload_equals_one_rank_synchronous, child_pids

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def five_layer_dir(tmp_path_factory):
    """Five decoder layers, tied embeddings: over 3 stages 1 + 2 + 2, the first holding the one table."""
    return build_model(str(tmp_path_factory.mktemp("qwen3_5_layers")), seed=3, num_hidden_layers=5,
                       tie_word_embeddings=True)


def test_pp2_matches_hf_with_caching_chunking_and_preemption(model_dir, prompts, reference):
    with LLM(model_dir, pipeline_parallel_size=2, max_model_len=400, max_num_batched_tokens=96,
             num_kvcache_blocks=30) as llm:
        assert_matches_hf_with_caching_chunking_and_preemption(llm, model_dir, prompts, reference)


def test_tp2_pp2_matches_hf(model_dir, prompts, reference):
    """Four ranks: two stages of two; rank t of a stage sends to rank t of the next."""
    before = set(child_pids())
    with LLM(model_dir, tensor_parallel_size=2, pipeline_parallel_size=2, max_model_len=400,
             max_num_batched_tokens=128, num_kvcache_blocks=40) as llm:
        assert len(set(child_pids()) - before) == 3
        assert_greedy_matches_hf(llm, model_dir, prompts, reference, GREEDY)
        layout = stage_layout(llm.model_runner)
    assert [(r["stage"], r["first_layer"], r["stop_layer"]) for r in layout] == [(0, 0, 1), (0, 0, 1), (1, 1, 2),
                                                                                (1, 1, 2)]
    assert not set(child_pids()) - before


def test_pp3_with_a_middle_stage_and_tied_embeddings_matches_hf(five_layer_dir, prompts, reference):
    with LLM(five_layer_dir, pipeline_parallel_size=3, max_model_len=400, max_num_batched_tokens=128) as llm:
        assert_greedy_matches_hf(llm, five_layer_dir, prompts[:6], reference, GREEDY)
        layout = stage_layout(llm.model_runner)
        names = [name for name, _ in llm.model_runner.model.named_parameters()]
    assert [(r["first_layer"], r["stop_layer"]) for r in layout] == [(0, 1), (1, 3), (3, 5)]
    # the first stage: the embeddings (= the LM head, tied) and layer 0 only; no final norm
    assert "model.embed_tokens.weight" in names and not any(n.startswith(("model.layers.1.", "model.norm"))
                                                             for n in names)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "llama"])
def test_pp2_of_other_families_matches_hf(tmp_path_factory, arch, prompts, reference):
    """Mixtures of experts (the first stage's share weighed by the experts a token visits) and Llama."""
    path = build_model(str(tmp_path_factory.mktemp(f"pp_{arch}")), arch=arch, seed=7)
    with LLM(path, pipeline_parallel_size=2, max_model_len=400, max_num_batched_tokens=128) as llm:
        assert_greedy_matches_hf(llm, path, prompts[:5], reference, GREEDY)


def test_pp2_overlapped_equals_pp1_synchronous_on_a_mixed_workload(model_dir):
    """(test_tensor_parallel's mixed workload) through two stages' micro-batches."""
    assert_mixed_workload_equals_one_rank_synchronous(model_dir, pipeline_parallel_size=2)


def test_pp2_prompt_logprobs_equal_pp1(model_dir):
    """The last stage sends every row of a run with prompt logprobs back, not only its sampling rows."""
    prompts = [[5, 17, 33, 2, 9, 100, 200, 300] * 4, [7, 8, 9] * 5]
    params = SamplingParams(max_tokens=2, prompt_logprobs=2)
    expected = LLM(model_dir, max_model_len=128, max_num_batched_tokens=16).generate(prompts, params, use_tqdm=False)
    with LLM(model_dir, pipeline_parallel_size=2, max_model_len=128, max_num_batched_tokens=16) as llm:
        got = llm.generate(prompts, params, use_tqdm=False)
    for mine_out, their_out in zip(got, expected, strict=True):
        for mine, theirs in zip(mine_out["prompt_logprobs"][1:], their_out["prompt_logprobs"][1:], strict=True):
            assert mine.keys() == theirs.keys() and all(abs(mine[t] - theirs[t]) < 1e-4 for t in mine)


def test_pp2_prompt_logprobs_of_a_step_cut_into_micro_batches_equal_pp1(model_dir):
    """One prefill step of four prompts (320 tokens) cut into micro-batches of whole sequences:
    each later micro-batch's prompt logprobs go to its own sequences (numbered in the step), as
    with one stage."""
    prompts = [[(7 * i + 3 * n) % 500 + 1 for i in range(n)] for n in (60, 70, 90, 100)]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=3)
    expected = LLM(model_dir, max_model_len=256).generate(prompts, params, use_tqdm=False)
    with LLM(model_dir, pipeline_parallel_size=2, max_model_len=256) as llm:
        time_stages(llm.model_runner, True)
        got = llm.generate(prompts, params, use_tqdm=False)
        times = stage_times(llm.model_runner)
        time_stages(llm.model_runner, False)
    assert times[0, 0, 4] >= 3  # (the prefill step's micro-batches: each holds whole sequences)
    for prompt, mine_out, their_out in zip(prompts, got, expected, strict=True):
        assert len(mine_out["prompt_logprobs"]) == len(prompt) and mine_out["prompt_logprobs"][0] is None
        for mine, theirs in zip(mine_out["prompt_logprobs"][1:], their_out["prompt_logprobs"][1:], strict=True):
            assert mine.keys() == theirs.keys() and all(abs(mine[t] - theirs[t]) < 1e-4 for t in mine)
        assert mine_out["token_ids"] == their_out["token_ids"]


def test_each_stage_holds_and_sizes_only_its_layers(model_dir):
    """Half the layers a stage: half the KV bytes a block, so twice the blocks in the same budget
    (CPU_KV_CACHE_BYTES; max_num_seqs x max_model_len sequences would take more)."""
    options = dict(max_model_len=1024, max_num_seqs=16384)
    one = LLM(model_dir, **options).model_runner
    with LLM(model_dir, pipeline_parallel_size=2, **options) as llm:
        layout = stage_layout(llm.model_runner)
        names = {name for name, _ in llm.model_runner.model.named_parameters()}
    assert [(r["first_layer"], r["stop_layer"]) for r in layout] == [(0, 1), (1, 2)]
    assert all(2 * r["kv_block_bytes"] == one.kv_block_bytes() for r in layout)
    assert all(r["num_kv_blocks"] == 2 * one.num_kv_blocks for r in layout)
    assert "lm_head.weight" in names and not any(".layers.1." in n or "model.norm" in n for n in names)


def test_layers_of_stage_cover_every_layer_once_the_first_lighter_by_the_lm_head():
    for num_layers in range(1, 30):
        for stages in range(2, num_layers + 1):
            for head in (0.0, 0.4, 2.0, 9.9, 100.0):
                parts = [layers_of_stage(num_layers, stages, s, head) for s in range(stages)]
                assert [i for part in parts for i in part] == list(range(num_layers))
                sizes = [len(p) for p in parts]
                assert min(sizes) >= 1 and sizes[1:] == sorted(sizes[1:]) and sizes[-1] - sizes[1] <= 1
                ideal = (num_layers + head) / stages - head  # (the first stage's share of the work, in layers)
                assert abs(sizes[0] - ideal) <= 0.5 or sizes[0] in (1, num_layers - stages + 1)
    # Qwen3-0.6B's LM head (151,936 x 1,024) is ~9.9 of its layers' work: 9 + 19 layers over 2 stages
    from transformers import Qwen3Config
    config = Qwen3Config(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                         num_attention_heads=16, num_key_value_heads=8, head_dim=128)
    assert round(head_cost_in_layers(config), 1) == 9.9
    assert [layers_of_stage(28, 2, s, head_cost_in_layers(config)) for s in (0, 1)] == [range(0, 9), range(9, 28)]
    # mixtures of experts: the experts a token visits (Qwen3-MoE's moe_intermediate_size, Mixtral's intermediate_size)
    from transformers import MixtralConfig, Qwen3MoeConfig
    moe = dict(vocab_size=32000, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128)
    mixtral = MixtralConfig(intermediate_size=14336, num_experts_per_tok=2, **moe)
    qwen3_moe = Qwen3MoeConfig(intermediate_size=99999, moe_intermediate_size=7168, num_experts_per_tok=4, **moe)
    assert head_cost_in_layers(mixtral) == pytest.approx(32000 / (128 * 80 + 6 * 14336))  # (hidden cancels)
    assert head_cost_in_layers(qwen3_moe) == pytest.approx(head_cost_in_layers(mixtral))


def batch(num_new, **extra):
    n = len(num_new)
    return StepBatch(np.arange(n, dtype=np.int32), np.zeros(n, dtype=np.int32), np.array(num_new, dtype=np.int32),
                     np.ones(n, dtype=bool), **extra)


def test_split_batch_cuts_whole_sequences_of_about_equal_tokens():
    decode = split_batch(batch([1] * 8, new_blocks=[(0, 0, [5])], new_tokens=[(3, [1, 2])],
                               prompt_logprobs=[(1, 0, 1, 0), (6, 0, 1, 2)]), 4)
    assert [list(r.rows) for r in decode] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert decode[0].new_blocks == [(0, 0, [5])] and decode[0].new_tokens == [(3, [1, 2])]  # (applied first)
    assert all(not r.new_blocks and not r.new_tokens for r in decode[1:])
    assert decode[0].prompt_logprobs == [(1, 0, 1, 0)] and decode[3].prompt_logprobs == [(0, 0, 1, 2)]
    assert [list(r.rows) for r in split_batch(batch([100, 1, 1, 1]), 4)] == [[0], [1, 2, 3]]
    assert [list(r.rows) for r in split_batch(batch([500]), 4)] == [[0]]
    assert [list(r.rows) for r in split_batch(batch([1, 1]), 4)] == [[0], [1]]


def test_num_micro_batches_needs_enough_tokens_for_each():
    assert num_micro_batches(32, 2, "cpu") == 1        # (a small decode step runs whole)
    assert num_micro_batches(128, 2, "cpu") == 2 and num_micro_batches(4096, 2, "cpu") == 4
    assert num_micro_batches(4096, 3, "cpu") == 6 and num_micro_batches(512, 2, "cuda") == 2


def test_decode_steps_in_micro_batches_equal_one_stage_and_are_timed(model_dir):
    """256 decoding sequences: 4 micro-batches of 64 a step (MIN_MICRO_BATCH_TOKENS on CPU), each
    stage's work and waits timed step by step (stage_times)."""
    prompts = [[i % 500 + 1, i // 500 + 1] * 3 for i in range(256)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    options = dict(max_model_len=64, max_num_seqs=256)
    expected = LLM(model_dir, **options).generate(prompts, params, use_tqdm=False)
    with LLM(model_dir, pipeline_parallel_size=2, **options) as llm:
        time_stages(llm.model_runner, True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        times = stage_times(llm.model_runner)
        time_stages(llm.model_runner, False)
    assert [o["token_ids"] for o in outputs] == [e["token_ids"] for e in expected]
    assert times.shape == (2, 6, 5)  # (ranks, steps: a prefill then 5 decodes, figures)
    assert times[0, :, 3].tolist() == [0, 1, 1, 1, 1, 1] and times[0, :, 4].tolist() == [4] * 6
    start, end, waited = times[..., 0], times[..., 1], times[..., 2]
    assert (np.diff(start, axis=1) > 0).all() and (end >= start).all() and (waited >= 0).all()
    assert (waited <= end - start + 1e-6).all() and waited[1].sum() > 0  # (stage 1 waits for stage 0)
    busy, over_decode = stage_busy(times, tp=1)
    assert busy.shape == (2, 6) and ((busy > 0) & (busy <= 1 + 1e-9)).all()
    assert all(0 < f <= 1 for f in over_decode)


def test_pipeline_server_answers_as_one_stage_and_ends_its_ranks(model_dir, tmp_path):
    """`nanovllm serve --pipeline-parallel-size 2`: the same greedy completion as
    one stage; SIGTERM ends the other stage's process too."""
    import subprocess

    from serving import Server, http, wait_for
    prompt = [5, 6, 7, 8]
    with LLM(model_dir, max_model_len=128) as reference:
        expected = reference.generate([prompt], GREEDY, use_tqdm=False)[0]
    server = Server(model_dir, tmp_path / "server.log", "--pipeline-parallel-size", "2", max_model_len=128)
    try:
        ranks = [int(pid) for pid in subprocess.run(["pgrep", "-P", str(server.proc.pid)], capture_output=True,
                                                    text=True).stdout.split()]
        body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        response = http(server, "POST", "/v1/completions", key=None, json=body)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected["text"]
    finally:
        assert server.stop() == 0, server.log()
    assert ranks and wait_for(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in ranks), timeout=15)


def test_the_gpu_warmup_runs_each_stage_alone_then_the_engine_is_exact(model_dir, prompts, reference):
    """gpu_memory.warmup (the largest step, which sizes the KV cache on CUDA) runs on every rank:
    each stage's layers on made-up inputs (warmup_logits), the LM head and sampler on the first.
    On CPU it is not part of start-up: run by hand here, then the engine must still be exact."""
    from nanovllm.engine.gpu_memory import warmup
    with LLM(model_dir, pipeline_parallel_size=2, max_model_len=128, max_num_batched_tokens=300) as llm:
        llm.model_runner.workers.call(warmup)
        warmup(llm.model_runner)
        assert_greedy_matches_hf(llm, model_dir, prompts[:4], reference, GREEDY)


@pytest.mark.parametrize("options, error, message", [
    (dict(pipeline_parallel_size=3), ValueError, r"pipeline_parallel_size=3 is more than the model's "
                                                 r"num_hidden_layers=2"),
    (dict(pipeline_parallel_size=0), ValueError, r"pipeline_parallel_size must be >= 1, got 0"),
    (dict(pipeline_parallel_size="2"), TypeError, r"pipeline_parallel_size must be an int, got '2'"),
    (dict(pipeline_parallel_size=2, speculative_config={"method": "ngram", "num_speculative_tokens": 2}),
     ValueError, r"speculative_config is not supported with pipeline_parallel_size > 1"),
])
def test_pipeline_options_are_checked(model_dir, options, error, message):
    with pytest.raises(error, match=message):
        LLM(model_dir, **options)

"""Gemma 3 (models/gemma3.py, layers/sliding_window.py): tiny random models built with transformers
equal Hugging Face greedy token for token (float32, CPU) with prompts far longer than the window,
chunked prefill, prefix caching, preemption and TP=2; the window's attention against a masked
reference; bad configs and backends refused at start-up."""
import json
import os
import random

import pytest
import torch

if not torch.cuda.is_available():  # (the triton backend's refusal below builds it on CPU: interpreted)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hf_reference import (assert_greedy_matches_hf, assert_logprobs_equal_hf, assert_prefix_cache_and_preemption,
                          assert_text_equals_hf_model, save_multimodal_model)
from nanovllm import LLM, SamplingParams
from nanovllm.engine.block_manager import chain_hash
from nanovllm.layers.sliding_window import gather_span, windowed_attend

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
WINDOW = 16
# local, global, local: prompts up to 300 tokens are many windows long; query_pre_attn_scalar 24
# (not head_dim 16) scales the scores; each kind its own RoPE base (10,000 local, 1,000,000 global)
LAYERS = dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              sliding_window=WINDOW, query_pre_attn_scalar=24, tie_word_embeddings=True)
MODELS = {
    "gemma3": ("gemma3", 0, LAYERS),
    # the global layers' RoPE linearly scaled (the 4B-27B checkpoints'), logits soft-capped, one KV head
    "gemma3_linear_softcap": ("gemma3", 1, dict(LAYERS, num_key_value_heads=1, final_logit_softcapping=3.0,
                                                rope_parameters={
                                                    "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                       "rope_theta": 1e6},
                                                    "sliding_attention": {"rope_type": "default",
                                                                          "rope_theta": 1e4}})),
}


@pytest.fixture
def gemma_dir(tiny_models):
    return lambda name: tiny_models(MODELS, name)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("options", [{}, dict(max_num_batched_tokens=64, kvcache_block_size=16)],
                         ids=["plain", "chunked-prefill"])
def test_gemma3_matches_hf(gemma_dir, prompts, reference, name, options):
    path = gemma_dir(name)
    assert max(map(len, prompts)) > 10 * WINDOW
    with LLM(path, max_model_len=400, **options) as llm:
        assert_greedy_matches_hf(llm, path, prompts, reference, GREEDY)


def test_gemma3_prefix_cache_and_preemption(gemma_dir, prompts, reference):
    """(The window found from the position, whoever computed the blocks before it.)"""
    assert_prefix_cache_and_preemption(gemma_dir("gemma3"), prompts, reference)


def test_a_sliding_window_layer_holds_its_window_not_the_sequence(gemma_dir, prompts, reference):
    """features/window_blocks.py: the local layers' blocks are a pool of their own, and a sequence
    holds there the blocks its next query's window reads: at most window / block + 1 = 2 once
    decoding, those of a 64-token chunk and the window before it while prefilling (6), while the
    global layer's pool holds every block. Nothing is left held after."""
    path = gemma_dir("gemma3")
    with LLM(path, max_model_len=400, kvcache_block_size=16, max_num_batched_tokens=64) as llm:
        manager, runner = llm.block_manager, llm.model_runner
        assert len(runner.attention_layers) == 1 and len(runner.window_layers) == 2
        assert runner.window_block_bytes() == 2 * runner.kv_block_bytes()  # (two local layers, one global)
        seqs = [seq for p in prompts[-3:] for seq in llm.add_request(p, GREEDY)]  # 150, 257, 300 tokens
        most_decoding = most_prefilling = 0
        while not llm.is_finished():
            llm.step()
            for seq in seqs:
                table = manager.tables.get(seq.seq_id)
                if table is None:
                    continue
                live = len(table.blocks) - table.first
                assert len(seq.block_table) * 16 >= seq.num_computed_tokens  # (the global layer's: all)
                if seq.num_computed_tokens > seq.num_prompt_tokens:
                    most_decoding = max(most_decoding, live)
                else:
                    most_prefilling = max(most_prefilling, live)
        assert most_decoding == WINDOW // 16 + 1 and most_prefilling <= (64 + WINDOW - 1) // 16 + 2
        assert manager.window.num_free_blocks == manager.window.num_blocks and not manager.tables
        assert [seq.completion_token_ids for seq in seqs] == [reference(path, p, 16) for p in prompts[-3:]]


def test_a_prefix_hit_ends_where_the_window_blocks_are_gone(gemma_dir, prompts, reference):
    """A cached prefix resumes only where the local layers' pool still holds the window before it:
    once other prompts have reused those blocks, a repeated prompt whose global blocks are all still
    cached recomputes (0 cached tokens) and equals HF."""
    path = gemma_dir("gemma3")
    long = prompts[-1][:150]
    with LLM(path, max_model_len=192, kvcache_block_size=16, max_num_seqs=2, max_num_batched_tokens=64,
             num_kvcache_blocks=200) as llm:
        assert llm.generate([long], GREEDY, use_tqdm=False)[0]["token_ids"] == reference(path, long, 16)
        assert llm.generate([long], GREEDY, use_tqdm=False)[0]["num_cached_tokens"] == 144
        manager = llm.block_manager
        assert manager.window.num_blocks == 10  # 2 rows x 2 + ceil((2 x 15 + 64) / 16)
        others = [[(7 * i + j) % 500 + 1 for j in range(150)] for i in range(3)]
        llm.generate(others, GREEDY, use_tqdm=False)  # (the window pool cycles over many times)
        keys, key = [], None
        for i in range(9):
            keys.append(key := chain_hash(key, long[16 * i:16 * (i + 1)]))
        assert all(key in manager.hash_to_block for key in keys)  # the global layer's blocks: all cached
        assert not any(key in manager.window.hash_to_block for key in keys[-1:])
        again = llm.generate([long], GREEDY, use_tqdm=False)[0]
        assert again["num_cached_tokens"] == 0 and again["token_ids"] == reference(path, long, 16)


def test_gemma3_tp2_matches_hf(gemma_dir, prompts, reference):
    path = gemma_dir("gemma3_linear_softcap")
    with LLM(path, tensor_parallel_size=2, max_model_len=400, max_num_batched_tokens=64, kvcache_block_size=16) as llm:
        assert_greedy_matches_hf(llm, path, prompts, reference, GREEDY)


def test_the_window_changes_the_answer(gemma_dir, prompts, reference, tmp_path):
    """(So the tests above can fail:) the same weights with a window of 4096 answer the long
    prompts differently from HF with the window of 16."""
    import shutil
    path = gemma_dir("gemma3")
    wide = str(tmp_path / "wide")
    shutil.copytree(path, wide)
    with open(f"{wide}/config.json") as f:
        config = json.load(f)
    config["sliding_window"] = 4096
    with open(f"{wide}/config.json", "w") as f:
        json.dump(config, f)
    with LLM(wide, max_model_len=400) as llm:
        outputs = llm.generate(prompts[-3:], GREEDY, use_tqdm=False)
    assert any(o["token_ids"] != reference(path, p, 16) for o, p in zip(outputs, prompts[-3:]))


# ---- the window's attention ---------------------------------------------------------------------

@pytest.mark.parametrize("n, length, window", [(1, 1, 4), (1, 40, 4), (5, 40, 4), (40, 40, 7), (3, 9, 16), (9, 9, 1)])
def test_windowed_attend_equals_a_masked_reference(n, length, window):
    """Query at position p sees keys p - window + 1 .. p: against softmax over a dense mask, given
    only the keys from the first query's window on (as the backend gathers them)."""
    g = torch.Generator().manual_seed(n * 100 + length)
    q, k, v = (torch.randn(rows, heads, 8, generator=g) for rows, heads in ((n, 4), (length, 2), (length, 2)))
    first_key = max(0, length - n - window + 1)
    got = windowed_attend(q, k[first_key:], v[first_key:], 0.3, window, length)
    kk, vv = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    for i in range(n):
        p = length - n + i
        visible = [j for j in range(length) if p - window < j <= p]
        scores = torch.einsum("hd,khd->hk", q[i], kk[visible]) * 0.3
        expected = torch.einsum("hk,khd->hd", scores.softmax(-1), vv[visible])
        torch.testing.assert_close(got[i], expected, rtol=1e-5, atol=1e-6)


def test_gather_span_reads_only_the_spans_blocks():
    cache = torch.arange(6 * 4 * 1 * 1, dtype=torch.float32).view(6, 4, 1, 1)
    table = torch.tensor([5, 2, 0, 3])
    full = cache[table].flatten(0, 1)
    for start, end in [(0, 16), (3, 9), (4, 8), (13, 14), (7, 7)]:
        assert torch.equal(gather_span(cache, table, start, end), full[start:end])


# ---- refused at start-up ------------------------------------------------------------------------

def edited(src, dst, **changes) -> str:
    from nanovllm.utils.tiny_model import edit_model
    return edit_model(src, str(dst), edit_config=lambda config: config.update(changes))


@pytest.mark.parametrize("changes, match", [
    (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]),
     r"layer type\(s\) \['chunked_attention'\] in config.layer_types are not supported"),
    (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0 is not supported"),
    (dict(hidden_activation="relu"), "hidden_activation='relu' is not supported for Gemma 3"),
])
def test_bad_configs_are_refused(gemma_dir, tmp_path, changes, match):
    with pytest.raises(ValueError, match=match):
        LLM(edited(gemma_dir("gemma3"), tmp_path / "bad", **changes))


def test_gemma3_on_the_triton_backend_matches_hf(gemma_dir, prompts, reference):
    """The Triton kernels' window (under the interpreter on CPU): chunked prefill over cached
    chunks, decode rows, and prompts many windows long."""
    pytest.importorskip("triton", reason="triton is not installed")
    path = gemma_dir("gemma3")
    with LLM(path, attention_backend="triton", device="cpu", max_model_len=400, max_num_batched_tokens=64,
             kvcache_block_size=16) as llm:
        assert_greedy_matches_hf(llm, path, prompts[3:6], reference, GREEDY)


def test_gemma3_on_flash_attn_matches_hf(gemma_dir, fake_flash_attn, prompts, reference):
    """flash-attn's window_size (W - 1, 0), through tests/fake_flash_attn (flash-attn's documented
    semantics in PyTorch): fresh prefill, chunks over cached pages of 256 and decode rows."""
    module, _ = fake_flash_attn
    path = gemma_dir("gemma3")
    with LLM(path, attention_backend="flash_attn", kvcache_block_size=256, max_model_len=400,
             max_num_batched_tokens=128) as llm:
        assert_greedy_matches_hf(llm, path, prompts, reference, GREEDY)
    assert {"flash_attn_varlen_func", "flash_attn_with_kvcache"} <= set(module.CALLS)


def test_a_backend_without_a_window_is_refused():
    from nanovllm.layers.sliding_window import windowed

    class NoWindow:
        @staticmethod
        def forward(q, k, v, k_cache, v_cache, context, scale, k_scale=None, v_scale=None):
            return q
    with pytest.raises(ValueError, match=r"sliding-window attention \(window 16\) runs on attention_backend="
                                         r"'torch', 'triton' or 'flash_attn', not on 'NoWindow'"):
        windowed(NoWindow, 16)


def test_a_plain_prompt_batch_of_random_lengths(gemma_dir, reference):
    """Sequences of many lengths decoding side by side (each its own window in one step)."""
    rng = random.Random(3)
    path = gemma_dir("gemma3")
    batch = [[rng.randrange(1, 512) for _ in range(rng.randint(10, 60))] for _ in range(6)]
    with LLM(path, max_model_len=128, kvcache_block_size=8) as llm:
        assert_greedy_matches_hf(llm, path, batch, reference, GREEDY)


@pytest.mark.parametrize("name", MODELS)
def test_gemma3_logprobs_equal_hf(gemma_dir, prompts, name):
    """Each emitted token's logprob equals Hugging Face's log_softmax of its logits (soft-capped
    where the config says: tanh keeps the argmax, so greedy tokens alone would not tell)."""
    assert_logprobs_equal_hf(gemma_dir(name), [prompts[1], prompts[4]], max_model_len=400)


def test_the_embedding_scale_is_rounded_to_the_model_dtype(gemma_dir):
    """sqrt(hidden_size) in the weights' dtype, as transformers multiplies: 55.5 for Gemma 3 4B's
    3072 in bf16 (not 55.4256), exact in float32 (built on the meta device: no memory)."""
    from transformers import AutoConfig
    from nanovllm.models.gemma3 import Gemma3ForCausalLM
    from nanovllm.utils.context import default_dtype_and_device
    config = AutoConfig.from_pretrained(gemma_dir("gemma3"))
    config.hidden_size = 3072
    for dtype, expected in ((torch.bfloat16, 55.5), (torch.float32, float(torch.tensor(3072 ** 0.5)))):
        with default_dtype_and_device(dtype, "meta"):
            assert Gemma3ForCausalLM(config, 64).model.embed_scale == expected


def test_pipeline_parallelism_is_refused(gemma_dir):
    """(Not wired in: its layers keep the residual stream themselves.) A ValueError reaches the caller."""
    with pytest.raises(ValueError, match="pipeline_parallel_size > 1 is not supported for Gemma 3"):
        LLM(gemma_dir("gemma3"), max_model_len=128, pipeline_parallel_size=2)


def test_gemma3_drafts_for_itself_with_every_draft_accepted(gemma_dir, prompts, reference):
    """An identical draft model proposes exactly what the target decodes: the draft gets the backend
    itself, so its global layers attend over the whole context and its local ones over their window
    (not the first layer's windowed form everywhere)."""
    path = gemma_dir("gemma3")
    draft = {"method": "draft_model", "model": path, "num_speculative_tokens": 3}
    with LLM(path, max_model_len=400, speculative_config=draft) as llm:
        assert_greedy_matches_hf(llm, path, prompts[4:], reference, GREEDY)
        stats = llm.stats()
    assert stats["spec_num_draft_tokens"] > 0
    assert stats["spec_num_accepted_tokens"] == stats["spec_num_draft_tokens"]


def test_the_multimodal_checkpoints_run_their_text_model(tmp_path, prompts):
    """Gemma3ForConditionalGeneration (the 4B-27B checkpoints): config.json's text_config, the text
    weights under model.language_model.*, the vision tower and projector skipped; greedy text equals
    Hugging Face's for the whole model, prompts many windows long; an image is refused."""
    import transformers
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    path = str(tmp_path / "gemma3_mm")
    hf = save_multimodal_model(path, transformers.Gemma3Config,
                               transformers.Gemma3ForConditionalGeneration, LAYERS, vision_config=vision,
                               mm_tokens_per_image=4, image_token_index=500, boi_token_index=501, eoi_token_index=502)
    assert assert_text_equals_hf_model(hf, path, prompts[3:6]) == "Gemma3ForConditionalGeneration"
    # its vision tower does not run here: an image is refused by name, not ignored
    import numpy as np
    from PIL import Image
    image = Image.fromarray(np.zeros((28, 28, 3), dtype=np.uint8))
    with LLM(path, max_model_len=128) as llm, pytest.raises(ValueError, match="takes no images here"):
        llm.generate([{"prompt_token_ids": [1, 500, 2], "multi_modal_data": {"image": image}}], GREEDY)


def test_a_captured_decode_step_reads_the_window_tables(gemma_dir, prompts):
    """WindowRunner.graph_group_context (what a CUDA graph captures, features/window_blocks.py):
    the local layers' Context has their rows' window tables and the slots they give, the scratch
    row (a graph's padding) the window pool's spare block."""
    from nanovllm.layers.sliding_window import WindowStep
    from nanovllm.utils.context import Context
    with LLM(gemma_dir("gemma3"), max_model_len=400, kvcache_block_size=16, max_num_batched_tokens=64) as llm:
        [seq] = llm.add_request(prompts[-1][:100], GREEDY)
        while seq.num_computed_tokens <= seq.num_prompt_tokens:  # (decoding now)
            llm.step()
        runner, p = llm.model_runner, seq.num_computed_tokens
        rows, positions = torch.tensor([seq.row, runner.scratch_row]), torch.tensor([p, 0])
        context = Context(block_tables=runner.block_tables[rows], decode_only=True)
        runner.graph_group_context(context, rows, positions)
        assert isinstance(context.layer_group, WindowStep)
        window = context.layer_group.context
        assert torch.equal(window.block_tables, runner.window_tables[rows])
        block = llm.block_manager.tables[seq.seq_id].blocks[p // 16]
        assert window.slot_mapping.tolist() == [block * 16 + p % 16, runner.num_window_blocks * 16]
        llm.abort(seq)


def test_the_window_pool_is_sized_for_every_row_at_once():
    """2 blocks a row for the window's edges, plus every row's W - 1 keys and a step's tokens; a window
    beyond max_model_len counts as max_model_len (gemma-3-1b's 512 with 256 tokens at most)."""
    from types import SimpleNamespace
    from nanovllm.features.window_blocks import num_window_blocks
    config = SimpleNamespace(max_num_seqs=512, block_size=16, max_model_len=4096, max_num_batched_tokens=16384,
                             hf_config=SimpleNamespace(sliding_window=512))
    assert num_window_blocks(config) == 2 * 512 + (512 * 511 + 16384) // 16 == 18400
    config.max_model_len = 256
    assert num_window_blocks(config) == 2 * 512 + -(-(512 * 255 + 16384) // 16)

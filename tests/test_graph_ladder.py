"""CUDA-graph bookkeeping that needs no GPU: the batch-size ladder, when a step may replay, and
capture itself with torch.cuda's graph API faked on the CPU (replays of the layer groups' steps too)."""
import contextlib
import os

import pytest
import torch

if not torch.cuda.is_available():  # (the layer groups' replays below run the triton backend: interpreted)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from nanovllm.engine.cuda_graphs import DecodeGraphs  # noqa: E402
from nanovllm.engine.step_inputs import graph_batch_sizes, padded_batch_size  # noqa: E402
from nanovllm.utils.context import get_context  # noqa: E402


@pytest.mark.parametrize("max_batch", [1, 3, 8, 16, 37, 100, 512])
def test_ladder_covers_every_batch_size(max_batch):
    sizes = graph_batch_sizes(max_batch)
    assert sizes == sorted(set(sizes)) and sizes[-1] == max_batch
    for batch in range(1, max_batch + 1):  # each batch pads to a captured size at most 15 rows larger
        assert 0 <= next(s for s in sizes if s >= batch) - batch <= 15


@pytest.mark.parametrize("max_batch", [1, 8, 37, 512])
def test_padded_batch_size_is_the_replayed_size(max_batch):
    sizes = graph_batch_sizes(max_batch)
    for batch in range(1, max_batch + 1):
        assert padded_batch_size(batch, sizes) == next(s for s in sizes if s >= batch)
    assert padded_batch_size(max_batch + 1, sizes) == max_batch + 1   # above the ladder: eager, unpadded


class FakeGraph:
    """torch.cuda.CUDAGraph's interface on the CPU: capture records nothing; replay logs the graph."""
    replayed: list = []

    def pool(self):
        return None

    def replay(self):
        FakeGraph.replayed.append(self)


class RecordingModel(torch.nn.Module):
    """Logs, for every forward, whether inference mode was on and what the context said."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = torch.nn.Linear(1, hidden_size)   # parameters that require grad, as a loaded model's do
        self.calls = []

    def forward(self, input_ids, positions):
        context = get_context()
        self.calls.append((input_ids.shape[0], torch.is_inference_mode_enabled(), context.padded_batch,
                           context.max_model_len, context.block_tables.shape))
        return self.proj(positions[:, None].float())


@pytest.fixture
def fake_cuda_graphs(monkeypatch):
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    FakeGraph.replayed = []


def test_capture_runs_under_inference_mode_with_the_padded_context(fake_cuda_graphs):
    """Warm-up and capture run as the steps do, under inference mode (no autograd recording in the
    graph), and each captured context carries the padded batch and max_model_len, the fields the
    eager path fills too, so attention sizes its split-KV alike in both."""
    model = RecordingModel(8)
    token_table = torch.zeros(9, 64, dtype=torch.int32)
    block_tables = torch.zeros(9, 4, dtype=torch.int32)
    graphs = DecodeGraphs(model, token_table, block_tables, block_size=16, scratch_row=8, max_batch=8,
                          max_model_len=64, hidden_size=8, dtype=torch.float32)
    assert [c[0] for c in model.calls] == [8, 8, 4, 4, 2, 2, 1, 1]            # warm-up + capture, largest first
    for size, inference, padded, max_len, table in model.calls:
        assert inference and padded == size and max_len == 64 and table == (size, 4)
    # a batch of 3 replays the graph of 4 (the caller pads its rows with the scratch row)
    with torch.inference_mode():
        out = graphs.replay(torch.tensor([1, 2, 3, 8]), torch.tensor([4, 5, 6, 0]), 4)
    assert FakeGraph.replayed == [graphs.graphs[4]] and out.shape == (4, 8)
    assert graphs.inputs[:2, :4].tolist() == [[1, 2, 3, 8], [4, 5, 6, 0]]


def test_a_captured_step_carries_the_other_layer_groups_context(fake_cuda_graphs):
    """group_context (features/window_blocks.py's window tables) is called with each captured
    step's Context, its rows and positions, before the model runs, so the graph gathers it too."""
    seen = []

    def group_context(context, rows, positions):
        context.layer_group = ("window", rows.clone(), positions.clone())

    class Recording(RecordingModel):
        def forward(self, input_ids, positions):
            seen.append(get_context().layer_group)
            return super().forward(input_ids, positions)

    graphs = DecodeGraphs(Recording(8), torch.zeros(9, 64, dtype=torch.int32), torch.zeros(9, 4, dtype=torch.int32),
                          block_size=16, scratch_row=8, max_batch=2, max_model_len=64, hidden_size=8,
                          dtype=torch.float32, group_context=group_context)
    assert len(seen) == 4 and all(kind == "window" for kind, _, _ in seen)
    assert [rows.tolist() for _, rows, _ in seen] == [[8, 8], [8, 8], [8], [8]]  # (the scratch row: padding)
    assert graphs.group_context is group_context


@pytest.fixture
def rerun_graphs(fake_cuda_graphs, monkeypatch):
    """CUDA graphs emulated on the CPU: capture runs the step once; a replay copies its inputs into
    the static buffers and runs the captured step's code again (what a graph replays, less what
    capture would bake in); the runner captures whatever its device."""
    from nanovllm.engine.model_runner import ModelRunner

    def replay(self, rows, positions, size, num_new=None):
        self.inputs[0, :size].copy_(rows)
        self.inputs[1, :size].copy_(positions)
        self.forward(size)
        return self.output[:size * self.query_len]
    monkeypatch.setattr(DecodeGraphs, "replay", replay)
    monkeypatch.setattr(ModelRunner, "_capture", lambda self, config: setattr(self, "graphs", self._capture_graphs()))


# the families with layers of other kinds (issue 48), at the sizes of their own tests
GROUPED = {"gemma3": dict(num_hidden_layers=3, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                          sliding_window=16, query_pre_attn_scalar=24, tie_word_embeddings=True),
           "gpt_oss": {}, "qwen3_5": {}}


@pytest.mark.parametrize("arch", GROUPED)
def test_decode_graphs_of_the_layer_groups_equal_hf(arch, rerun_graphs, tmp_path, prompts, reference):
    """Replayed decode steps read the other groups' data from their static inputs (the window
    tables, the state slots: graph_group_context), and still give Hugging Face's tokens."""
    pytest.importorskip("triton", reason="triton is not installed")
    from nanovllm import LLM, SamplingParams
    from nanovllm.utils.tiny_model import build_model
    path = build_model(str(tmp_path / arch), arch=arch, **GROUPED[arch])
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with LLM(path, attention_backend="triton", device="cpu", max_model_len=400, max_num_seqs=4,
             kvcache_block_size=16, max_num_batched_tokens=64) as llm:
        assert llm.model_runner.graphs is not None
        FakeGraph.replayed = []
        outputs = llm.generate(prompts[3:6], params, use_tqdm=False)
        assert len(FakeGraph.replayed) == 0  # (the emulation reruns forward: no fake replay logged)
    assert [o["token_ids"] for o in outputs] == [reference(path, p, 8) for p in prompts[3:6]]


def test_a_vl_models_decode_steps_replay_for_text_alone_and_run_eagerly_with_images(rerun_graphs, monkeypatch,
                                                                                  tmp_path):
    """features/multimodal.py: a decode step of text alone replays its graph (and equals HF); one
    holding a sequence with images, whose M-RoPE positions run behind its token positions, runs
    eagerly, and gives what an eager engine gives."""
    pytest.importorskip("triton", reason="triton is not installed")
    import numpy as np
    from PIL import Image
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil
    from hf_reference import greedy_of, save_multimodal_model
    from nanovllm import LLM, SamplingParams
    path = str(tmp_path / "vl")
    hf = save_multimodal_model(path, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, dict(rope_parameters={
        "rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}), vision_config=dict(
        depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
        temporal_patch_size=2, spatial_merge_size=2), image_token_id=500, vision_start_token_id=501,
        vision_end_token_id=502)
    Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=256,
                             max_pixels=48 * 48 * 16).save_pretrained(path)
    replays = []
    replay = DecodeGraphs.replay
    monkeypatch.setattr(DecodeGraphs, "replay", lambda self, *args: replays.append(args[2]) or replay(self, *args))
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 40, 3), dtype=np.uint8))
    request = {"prompt_token_ids": [7, 501, 500, 502, 9, 10], "multi_modal_data": {"image": image}}
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    options = dict(attention_backend="triton", device="cpu", max_model_len=256, max_num_seqs=4, kvcache_block_size=16)
    with LLM(path, **options) as llm:
        assert llm.model_runner.graphs is not None
        text_prompts = [[7, 8, 9], [10, 11, 12, 13]]
        text = llm.generate(text_prompts, params, use_tqdm=False)
        assert replays and [o["token_ids"] for o in text] == [greedy_of(hf, p, 6) for p in text_prompts]
        replays.clear()
        with_image = llm.generate([request], params, use_tqdm=False)[0]["token_ids"]
        assert replays == []
    with LLM(path, enforce_eager=True, **options) as llm:
        assert llm.generate([request], params, use_tqdm=False)[0]["token_ids"] == with_image

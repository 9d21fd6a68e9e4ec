"""Qwen3-VL's vision tower (models/qwen3_vl_vision.py) against transformers': a tiny random
Qwen3VLForConditionalGeneration (float32, CPU, every parameter drawn at random, norms included), its
model.visual.* weights loaded into the tower by name, equals get_image_features image for image, its
merged embeddings and every DeepStack feature: square and oblong grids, two images in one call, two
frames, and pixels from the real (PIL) image processor. A toy table of 4 x 4 learned positions, so that
every grid here interpolates it, and a check that the interpolation changes the output."""
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2VLImageProcessorPil, Qwen3VLConfig, Qwen3VLForConditionalGeneration

from hf_reference import random_vision_language_model, vision_tower_of
from nanovllm.models.qwen3_vl_vision import Qwen3VisionTower

PATCH, TEMPORAL, MERGE = 4, 2, 2
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=PATCH,
              temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE, num_position_embeddings=16,  # 4 x 4
              deepstack_visual_indexes=[0, 1])
TEXT = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, vocab_size=128, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                          "mrope_section": [6, 5, 5], "mrope_interleaved": True})
PATCH_DIM = 3 * TEMPORAL * PATCH * PATCH


def random_hf_model(**vision_overrides) -> Qwen3VLForConditionalGeneration:
    return random_vision_language_model(Qwen3VLConfig, Qwen3VLForConditionalGeneration, {**VISION, **vision_overrides},
                                        TEXT)


def tower_of(hf: Qwen3VLForConditionalGeneration) -> Qwen3VisionTower:
    return vision_tower_of(hf, Qwen3VisionTower)


@pytest.fixture(scope="module")
def hf():
    return random_hf_model()


@pytest.fixture(scope="module")
def tower(hf):
    return tower_of(hf)


def hf_image_features(hf, pixel_values, grid_thw) -> tuple[torch.Tensor, list[torch.Tensor]]:
    with torch.no_grad():
        out = hf.get_image_features(pixel_values, grid_thw)
    return torch.cat(out.pooler_output), [torch.cat(per_image) for per_image in out.deepstack_features]


def random_pixels(grid_thw: torch.Tensor) -> torch.Tensor:
    return torch.randn(int(grid_thw.prod(-1).sum()), PATCH_DIM, generator=torch.Generator().manual_seed(1))


def assert_tower_equals_hf(tower, hf, pixel_values, grid_thw):
    with torch.no_grad():
        ours, ours_deepstack = tower(pixel_values, grid_thw)
    theirs, theirs_deepstack = hf_image_features(hf, pixel_values, grid_thw)
    tokens = sum(tower.num_image_tokens(g) for g in grid_thw)
    assert ours.shape == (tokens, VISION["out_hidden_size"])
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert len(ours_deepstack) == len(theirs_deepstack) == len(hf.config.vision_config.deepstack_visual_indexes)
    for feature, expected in zip(ours_deepstack, theirs_deepstack):
        assert feature.shape == (tokens, VISION["out_hidden_size"])
        torch.testing.assert_close(feature, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("grids", [
    [(1, 8, 8)],                # the 4 x 4 positions stretched over 8 x 8 patches
    [(1, 12, 8)],               # oblong: rows and columns interpolated differently
    [(1, 8, 8), (1, 10, 6)],    # two images in one call: attention and positions per image
    [(2, 8, 12)],               # two frames: attention per frame, the same positions for each
], ids=["8x8", "12x8", "two-images", "two-frames"])
def test_tower_equals_hf_get_image_features(tower, hf, grids):
    grid_thw = torch.tensor(grids, dtype=torch.int64)
    assert_tower_equals_hf(tower, hf, random_pixels(grid_thw), grid_thw)


def test_tower_equals_hf_on_the_image_processors_pixels(tower, hf):
    # Qwen3-VL's processor is Qwen2-VL's (image_processing_auto: qwen3_vl -> Qwen2VLImageProcessorPil),
    # its checkpoints normalising by mean = std = 0.5
    processor = Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL,
                                         min_pixels=16 * 16, max_pixels=64 * 64,
                                         image_mean=[0.5] * 3, image_std=[0.5] * 3)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8)),   # h x w
              Image.fromarray(rng.integers(0, 256, (30, 20, 3), dtype=np.uint8))]
    batch = processor(images=images, return_tensors="pt")
    assert batch["image_grid_thw"].tolist() == [[1, 10, 14], [1, 8, 4]]  # 40 x 56 and 32 x 16 pixels (resized)
    assert_tower_equals_hf(tower, hf, batch["pixel_values"], batch["image_grid_thw"])


def test_deepstack_features_in_block_order(hf):
    """Unsorted indexes, the last block among them: the features come in block order, each block through
    the merger at its index's place in the list (as transformers appends them)."""
    shuffled = random_hf_model(deepstack_visual_indexes=[2, 0])
    shuffled.load_state_dict(hf.state_dict())
    grid_thw = torch.tensor([(1, 12, 8)])
    assert_tower_equals_hf(tower_of(shuffled), shuffled, random_pixels(grid_thw), grid_thw)


def test_position_interpolation_matters(hf, tower):
    """Resampling the table matters here: the image's own positions are not a corner of the table, and
    the rows and columns are not interchangeable (the comparison would miss a swap otherwise)."""
    grid_thw = torch.tensor([(1, 12, 8)])
    with torch.no_grad():
        positions = tower.embed(torch.zeros(96, PATCH_DIM), grid_thw) - tower.patch_embed.proj.bias
        table = hf.model.visual.pos_embed.weight.view(4, 4, -1)
    patch = {(r, c): i for i, (r, c) in enumerate(
        (2 * br + dr, 2 * bc + dc) for br in range(6) for bc in range(4) for dr in range(2) for dc in range(2))}
    torch.testing.assert_close(positions[patch[0, 0]], table[0, 0])      # corners on corners
    torch.testing.assert_close(positions[patch[11, 7]], table[3, 3])
    torch.testing.assert_close(positions[patch[11, 0]], table[3, 0])
    assert (positions[patch[0, 1]] - table[0, 1]).abs().max() > 1e-2    # between the table's columns


def test_num_image_tokens(tower):
    assert tower.num_image_tokens(torch.tensor([1, 10, 14])) == 35
    assert tower.num_image_tokens((2, 8, 12)) == 48

"""Qwen2.5-VL's vision tower (models/qwen2_5_vl_vision.py) against transformers': a tiny random
Qwen2_5_VLForConditionalGeneration (float32, CPU, every parameter drawn at random, norms included),
its model.visual.* weights loaded into the tower by name, equals get_image_features image for image:
grids a multiple of the attention window and not, two images in one call, two frames, and pixels
from the real (PIL) image processor. A toy window of 2 x 2 merge blocks, so that window attention
windows, and a check that it changes the output (the comparison would miss it otherwise)."""
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil

from hf_reference import random_vision_language_model, vision_tower_of
from nanovllm.models.qwen2_5_vl_vision import Qwen2_5VisionTower

PATCH, TEMPORAL, MERGE = 4, 2, 2
VISION = dict(depth=4, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=48, patch_size=PATCH,
              temporal_patch_size=TEMPORAL, spatial_merge_size=MERGE, window_size=16,  # 16 // 2 // 4: 2 x 2 blocks
              fullatt_block_indexes=[1, 3])
TEXT = dict(hidden_size=48, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=128, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 4, 4]})
PATCH_DIM = 3 * TEMPORAL * PATCH * PATCH


def random_hf_model(**vision_overrides) -> Qwen2_5_VLForConditionalGeneration:
    return random_vision_language_model(Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                                        {**VISION, **vision_overrides}, TEXT)


def tower_of(hf: Qwen2_5_VLForConditionalGeneration) -> Qwen2_5VisionTower:
    return vision_tower_of(hf, Qwen2_5VisionTower)


@pytest.fixture(scope="module")
def hf():
    return random_hf_model()


@pytest.fixture(scope="module")
def tower(hf):
    return tower_of(hf)


def hf_image_features(hf, pixel_values, grid_thw) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat(hf.get_image_features(pixel_values, grid_thw).pooler_output)


def random_pixels(grid_thw: torch.Tensor) -> torch.Tensor:
    return torch.randn(int(grid_thw.prod(-1).sum()), PATCH_DIM, generator=torch.Generator().manual_seed(1))


def assert_tower_equals_hf(tower, hf, pixel_values, grid_thw):
    with torch.no_grad():
        ours = tower(pixel_values, grid_thw)
    assert ours.shape == (sum(tower.num_image_tokens(g) for g in grid_thw), VISION["out_hidden_size"])
    torch.testing.assert_close(ours, hf_image_features(hf, pixel_values, grid_thw), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("grids", [
    [(1, 8, 8)],                # 2 x 2 whole windows
    [(1, 12, 8)],               # 6 x 4 blocks: a window's multiple on neither side for HF's padding
    [(1, 10, 14)],              # 5 x 7 blocks: the last row and column of windows cut short
    [(1, 8, 8), (1, 10, 6)],    # two images in one call, windows and full attention per image
    [(2, 8, 12)],               # two frames: windows and "full" attention per frame
], ids=["8x8", "12x8", "10x14", "two-images", "two-frames"])
def test_tower_equals_hf_get_image_features(tower, hf, grids):
    grid_thw = torch.tensor(grids, dtype=torch.int64)
    assert_tower_equals_hf(tower, hf, random_pixels(grid_thw), grid_thw)


def test_tower_equals_hf_on_the_image_processors_pixels(tower, hf):
    processor = Qwen2VLImageProcessorPil(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL,
                                         min_pixels=16 * 16, max_pixels=64 * 64)
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (40, 56, 3), dtype=np.uint8)),   # h x w
              Image.fromarray(rng.integers(0, 256, (30, 20, 3), dtype=np.uint8))]
    batch = processor(images=images, return_tensors="pt")
    assert batch["image_grid_thw"].tolist() == [[1, 10, 14], [1, 8, 4]]  # 40 x 56 and 32 x 16 pixels (resized)
    assert_tower_equals_hf(tower, hf, batch["pixel_values"], batch["image_grid_thw"])


def test_window_attention_matters(hf):
    """With every block attending over the whole image, the output changes: the windows are real here."""
    grid_thw = torch.tensor([(1, 12, 8)])
    pixels = random_pixels(grid_thw)
    full = random_hf_model(fullatt_block_indexes=list(range(VISION["depth"])))
    full.load_state_dict(hf.state_dict())
    windowed, unwindowed = hf_image_features(hf, pixels, grid_thw), hf_image_features(full, pixels, grid_thw)
    assert (windowed - unwindowed).abs().max() > 1e-2
    with torch.no_grad():
        torch.testing.assert_close(tower_of(full)(pixels, grid_thw), unwindowed, atol=1e-5, rtol=1e-5)


def test_num_image_tokens(tower):
    assert tower.num_image_tokens(torch.tensor([1, 10, 14])) == 35
    assert tower.num_image_tokens((2, 8, 12)) == 48

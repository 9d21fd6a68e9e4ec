"""Qwen2.5-VL and Qwen3-VL with images (models/qwen2_5_vl.py, qwen3_vl.py, features/multimodal.py):
tiny random models of each built with transformers, their PIL image processor beside them,
equals Hugging Face greedy token for token (float32, CPU) for text alone, one image, an image of
another size, two images in a prompt, and a chunked prefill that splits an image's tokens; images
are in the prefix-cache keys (two images with the same text share no block, the same image hits);
preemption recomputes; bad input is refused by name."""
import base64
import io
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessorPil,
                          Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                          Qwen3_5MoeForConditionalGeneration, Qwen3VLConfig,
                          Qwen3VLForConditionalGeneration)

from hf_reference import QWEN3_5_VISION, save_multimodal_model
from nanovllm import LLM, SamplingParams
from nanovllm.utils.tiny_model import FAMILY_SETTINGS, LINEAR_ATTENTION_SETTINGS, build_tokenizer
from serving import KEY, Server, error_of, http, openai_client

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
IMAGE, START, END = 500, 501, 502  # the placeholder, <|vision_start|>, <|vision_end|>
PATCH, MERGE = 4, 2
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=PATCH,
              temporal_patch_size=2, spatial_merge_size=MERGE, window_size=16, fullatt_block_indexes=[1])
TEXT = dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
FAMILIES = {  # (config class, model class, vision config, text config)
    "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, VISION, TEXT),
    # a 4 x 4 table of learned positions (interpolated to every grid here), DeepStack after 2 of 3 blocks
    # into the first 2 text layers, interleaved M-RoPE
    "qwen3_vl": (Qwen3VLConfig, Qwen3VLForConditionalGeneration,
                 dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=PATCH,
                      temporal_patch_size=2, spatial_merge_size=MERGE, num_position_embeddings=16,
                      deepstack_visual_indexes=[0, 1]),
                 dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                       "mrope_interleaved": True})),
    # three Gated DeltaNet layers and a gated full-attention one whose partial RoPE (half of heads of 32)
    # turns 8 frequencies on the default interleaved grids; Qwen3-VL's tower without DeepStack
    "qwen3_5": (Qwen3_5Config, Qwen3_5ForConditionalGeneration, QWEN3_5_VISION["vision_config"],
                dict(LINEAR_ATTENTION_SETTINGS, head_dim=32, rope_parameters={
                    "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # the same with Qwen3.5-MoE's layers: 4 routed experts (2 a token) and a gated shared one
    "qwen3_5_moe": (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration, QWEN3_5_VISION["vision_config"],
                    dict(FAMILY_SETTINGS["qwen3_5_moe"], head_dim=32, rope_parameters={
                        "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def vl(request, tmp_path_factory):
    """(folder, the HF model in memory, its image processor), of each family in turn."""
    config_class, model_class, vision, text = FAMILIES[request.param]
    path = str(tmp_path_factory.mktemp(request.param))
    model = save_multimodal_model(path, config_class, model_class, text, vision_config=vision,
                                  image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END)
    processor = Qwen2VLImageProcessorPil(patch_size=PATCH, temporal_patch_size=2, merge_size=MERGE,
                                         min_pixels=8 * 8 * 16, max_pixels=48 * 48 * 16)
    processor.save_pretrained(path)
    return path, model, processor


# The Qwen2.5-VL chat template's shape: ChatML turns, an image part as its placeholder.
VL_TEMPLATE = ("{%- for m in messages -%}<|im_start|>{{ m.role }}\n{%- if m.content is string -%}{{ m.content }}"
               "{%- else -%}{%- for part in m.content -%}{%- if part.type == 'image' -%}"
               "<|vision_start|><|image_pad|><|vision_end|>{%- elif part.type == 'text' -%}{{ part.text }}{%- endif -%}"
               "{%- endfor -%}{%- endif -%}<|im_end|>\n{%- endfor -%}"
               "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}")
VL_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]


def vl_tokenizer(path: str):
    """The tiny tokenizer with the vision tokens and VL_TEMPLATE, saved at path (the same ids each time)."""
    tokenizer = build_tokenizer(path)
    tokenizer.add_special_tokens({"additional_special_tokens": VL_TOKENS})
    tokenizer.chat_template = VL_TEMPLATE
    tokenizer.save_pretrained(path)
    return tokenizer


@pytest.fixture(scope="module")
def vl_chat(tmp_path_factory):
    """vl's model with a tokenizer that has the vision tokens and a chat template: (folder, HF model,
    image processor, tokenizer)."""
    path = str(tmp_path_factory.mktemp("qwen2_5_vl_chat"))
    start, image, end = vl_tokenizer(path).convert_tokens_to_ids(VL_TOKENS)
    model = save_multimodal_model(path, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, TEXT,
                                  vision_config=VISION, image_token_id=image, vision_start_token_id=start,
                                  vision_end_token_id=end)
    tokenizer = vl_tokenizer(path)  # (save_multimodal_model wrote the plain one)
    assert tokenizer.convert_tokens_to_ids(VL_TOKENS) == [start, image, end]
    processor = Qwen2VLImageProcessorPil(patch_size=PATCH, temporal_patch_size=2, merge_size=MERGE,
                                         min_pixels=8 * 8 * 16, max_pixels=48 * 48 * 16)
    processor.save_pretrained(path)
    return path, model, processor, tokenizer


def data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def chat_messages(url: str) -> list[dict]:
    return [{"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "what is in it?"}]}]


def picture(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def prompt_with(images: list, text: list[int]) -> list[int]:
    """One <|vision_start|><|image_pad|><|vision_end|> per image, then the text."""
    return [7, 8] + [START, IMAGE, END] * len(images) + text


@torch.inference_mode()
def hf_answer(vl, prompt: list[int], images: list, n: int = GREEDY.max_tokens) -> list[int]:
    """HF's greedy completion: the placeholders expanded by the image processor's grids, HF's own M-RoPE."""
    _, model, processor = vl[:3]
    image_id = model.config.image_token_id
    ids, kwargs = list(prompt), {}
    if images:
        out = processor(images=images, return_tensors="pt")
        expanded, grids = [], iter(out["image_grid_thw"].tolist())
        for t in ids:
            expanded += [image_id] * (np.prod(next(grids)) // MERGE ** 2) if t == image_id else [t]
        ids = expanded
        kwargs = dict(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"],
                      mm_token_type_ids=(torch.tensor([ids]) == image_id).int())
    tensor = torch.tensor([ids])
    out = model.generate(tensor, attention_mask=torch.ones_like(tensor), max_new_tokens=n, do_sample=False,
                         eos_token_id=None, pad_token_id=0, **kwargs)
    return out[0, len(ids):].tolist()


def request(prompt, images):
    return {"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}


def test_text_and_images_match_hf(vl):
    """Text alone; one image; one of another size (not a multiple of the attention window); two in one prompt."""
    small, wide, tall = picture(32, 32, 0), picture(56, 40, 1), picture(24, 48, 2)
    cases = [([], list(range(20, 60))), ([small], [30, 31, 32]), ([wide], [40, 41]), ([small, tall], [50, 51, 52])]
    with LLM(vl[0], max_model_len=256) as llm:
        outputs = llm.generate([request(prompt_with(images, text), images) for images, text in cases], GREEDY,
                               use_tqdm=False)
        for (images, text), out in zip(cases, outputs):
            assert out["token_ids"] == hf_answer(vl, prompt_with(images, text), images), f"{len(images)} images"


def test_a_chunked_prefill_splits_an_image_and_encodes_it_once(vl, monkeypatch):
    """16-token steps over an image of 36 tokens: its tokens come in three chunks, from one encoding."""
    from nanovllm.models.qwen2_5_vl import VisionLanguageModel as Ours
    calls = []
    encode = Ours.encode_images
    monkeypatch.setattr(Ours, "encode_images", lambda self, pixels, grids: calls.append(len(grids))
                        or encode(self, pixels, grids))
    image = picture(48, 48, 3)
    prompt = prompt_with([image], [9, 10, 11])
    with LLM(vl[0], max_model_len=256, max_num_batched_tokens=16, kvcache_block_size=16) as llm:
        out = llm.generate([request(prompt, [image])], GREEDY, use_tqdm=False)[0]
        assert llm.model_runner.encoded == {}  # (consumed: nothing kept)
    assert out["token_ids"] == hf_answer(vl, prompt, [image])
    assert calls == [1]


def test_a_steps_images_stay_within_the_encoder_budget(vl, monkeypatch):
    """Two requests of a 36-token image each, 64-token steps: the first step encodes the first image
    alone (the second's 36 tokens would pass the budget of 64: its chunk ends before its image),
    the next step the second; both answers HF's."""
    from nanovllm.models.qwen2_5_vl import VisionLanguageModel as Ours
    calls = []
    encode = Ours.encode_images
    monkeypatch.setattr(Ours, "encode_images", lambda self, pixels, grids: calls.append(len(grids))
                        or encode(self, pixels, grids))
    images = [picture(48, 48, 40), picture(48, 48, 41)]
    prompts = [prompt_with([image], [9, 10, 11]) for image in images]
    with LLM(vl[0], max_model_len=256, max_num_batched_tokens=64, kvcache_block_size=16) as llm:
        outputs = llm.generate([request(p, [i]) for p, i in zip(prompts, images)], GREEDY, use_tqdm=False)
    assert calls == [1, 1]
    assert [o["token_ids"] for o in outputs] == [hf_answer(vl, p, [i]) for p, i in zip(prompts, images)]


def test_images_are_in_the_prefix_cache_keys(vl):
    """The same text with two different images shares no block (each gets its own HF answer); the
    same image and text again reports cached tokens and the same answer."""
    first, second = picture(48, 48, 4), picture(48, 48, 5)
    prompt = prompt_with([first], [12, 13, 14])
    with LLM(vl[0], max_model_len=256, kvcache_block_size=16) as llm:
        a = llm.generate([request(prompt, [first])], GREEDY, use_tqdm=False)[0]
        b = llm.generate([request(prompt, [second])], GREEDY, use_tqdm=False)[0]
        again = llm.generate([request(prompt, [first])], GREEDY, use_tqdm=False)[0]
    assert a["token_ids"] == hf_answer(vl, prompt, [first]) and b["token_ids"] == hf_answer(vl, prompt, [second])
    assert b["num_cached_tokens"] == 0  # (its text's blocks are cached, but hold another image)
    assert again["num_cached_tokens"] == 32 and again["token_ids"] == a["token_ids"]


def test_preemption_recomputes_images_and_leaks_nothing(vl):
    """Four image prompts of 30 tokens (4 blocks of 8) under 12 KV blocks: three are admitted, and
    each needs more blocks as it decodes."""
    images = [picture(32, 32, 10 + i) for i in range(4)]
    prompts = [prompt_with([image], [60 + i] * 10) for i, image in enumerate(images)]  # 16 image tokens + 14
    with LLM(vl[0], max_model_len=96, kvcache_block_size=8, num_kvcache_blocks=12, max_num_seqs=4) as llm:
        outputs = llm.generate([request(p, [i]) for p, i in zip(prompts, images)], GREEDY, use_tqdm=False)
        stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["num_free_blocks"] == stats["num_blocks"]
    for prompt, image, out in zip(prompts, images, outputs):
        assert out["token_ids"] == hf_answer(vl, prompt, [image])


def test_tensor_parallel_ranks_encode_their_images_and_match_hf(vl):
    """TP=2 over gloo: the text model split, the tower whole on each rank, the patches in the step's message."""
    small, tall = picture(32, 32, 20), picture(24, 48, 21)
    cases = [([small], [30, 31, 32]), ([small, tall], [50, 51])]
    with LLM(vl[0], tensor_parallel_size=2, max_model_len=256, max_num_batched_tokens=32,
             kvcache_block_size=16) as llm:
        outputs = llm.generate([request(prompt_with(images, text), images) for images, text in cases], GREEDY,
                               use_tqdm=False)
    for (images, text), out in zip(cases, outputs):
        assert out["token_ids"] == hf_answer(vl, prompt_with(images, text), images)


@pytest.mark.parametrize("prompt, match", [
    ({"prompt_token_ids": [1, IMAGE], "multi_modal_data": {"image": []}}, None),  # no image: a text prompt
    ({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": "x.png"}}, "a PIL image, a numpy array or a tensor"),
    ({"prompt_token_ids": [1, 2], "multi_modal_data": {"image": [picture(32, 32, 0)]}}, "0 image placeholder"),
    ({"prompt_token_ids": [1, IMAGE], "multi_modal_data": {"video": [1]}}, "multi_modal_data takes"),
    ({"prompt_token_ids": [1], "prompt": "a"}, "exactly one of"),
    ({"prompt_token_ids": [1], "images": []}, "a prompt dict takes the keys"),
])
def test_bad_image_requests_are_refused_by_name(vl, prompt, match):
    with LLM(vl[0], max_model_len=128) as llm:
        if match is None:
            assert llm.generate([prompt], GREEDY, use_tqdm=False)[0]["token_ids"]
            return
        with pytest.raises((TypeError, ValueError), match=match):
            llm.generate([prompt], GREEDY, use_tqdm=False)
        stats = llm.stats()
        assert stats["num_free_blocks"] == stats["num_blocks"]


def test_the_image_chat_example_runs(vl_chat, tmp_path):
    """examples/image_chat.py: a PNG file's answer, LLM.chat's through its data URL."""
    import os
    import subprocess
    import sys
    image = picture(40, 32, 32)
    image.save(tmp_path / "x.png")
    with LLM(vl_chat[0]) as llm:
        expected = llm.chat([{"role": "user", "content": [{"type": "image", "image": image},
                                                          {"type": "text", "text": "what?"}]}],
                            SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)["text"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "examples", "image_chat.py"), vl_chat[0],
                          str(tmp_path / "x.png"), "what?", "--max-tokens", "6"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": root}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected + "\n"


def test_chat_with_a_data_url_equals_generate_and_hf(vl_chat):
    """LLM.chat: the image_url part decoded (a PNG data URL: lossless), rendered as the template's
    placeholder; equal to generate() of the template's ids with the image, to an image given offline
    ({"type": "image", "image": ...}), and to HF. An http(s) URL is refused offline."""
    path, _, _, tokenizer = vl_chat
    image = picture(40, 32, 30)
    template = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is in it?"}]}]
    ids = tokenizer.apply_chat_template(template, add_generation_prompt=True, tokenize=True, return_dict=False)
    with LLM(path, max_model_len=256) as llm:
        chat = llm.chat(chat_messages(data_url(image)), GREEDY, use_tqdm=False)
        plain = llm.generate([request(ids, [image])], GREEDY, use_tqdm=False)[0]
        offline_parts = [{"type": "image", "image": image}, template[1]["content"][1]]
        offline = llm.chat([template[0], {"role": "user", "content": offline_parts}], GREEDY, use_tqdm=False)
    assert chat["token_ids"] == plain["token_ids"] == offline["token_ids"] == hf_answer(vl_chat, ids, [image])
    with pytest.raises(ValueError, match="image URLs over http"), LLM(path, max_model_len=256) as llm:
        llm.chat(chat_messages("https://example.com/cat.png"), GREEDY)


class ImageFiles(BaseHTTPRequestHandler):
    """A local HTTP server's images: /cat.png, /big.png (past the server's --max-image-bytes), a 302, a 404."""
    files: dict[str, bytes] = {}

    def do_GET(self):
        if self.path == "/redirect":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
        elif self.path in self.files:
            self.send_response(200)
            self.send_header("Content-Length", str(len(self.files[self.path])))
            self.end_headers()
            self.wfile.write(self.files[self.path])
        else:
            self.send_error(404)

    def log_message(self, *args):
        pass


def test_the_server_takes_image_url_parts_and_refuses_bad_images(vl_chat, tmp_path):
    """/v1/chat/completions through the official openai client, a data URL and an allowed http URL of
    the same PNG: the same text as LLM.chat. Each bad image a 400 saying what is wrong, the server
    serving after them (the same answer), nothing left running."""
    path = vl_chat[0]
    image = picture(40, 32, 31)
    url = data_url(image)
    with LLM(path, max_model_len=256) as llm:
        expected = llm.chat(chat_messages(url), GREEDY, use_tqdm=False)["text"]
    ImageFiles.files = {"/cat.png": base64.b64decode(url.split(",")[1]), "/big.png": bytes(30000)}
    files = ThreadingHTTPServer(("127.0.0.1", 0), ImageFiles)
    threading.Thread(target=files.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{files.server_port}"
    server = Server(path, tmp_path / "server.log", "--api-key", KEY, "--allowed-media-domains", "127.0.0.1",
                    "--max-image-bytes", "20000", "--image-fetch-timeout", "2", max_model_len=256)
    try:
        client = openai_client(server)
        for source in (url, base + "/cat.png"):
            reply = client.chat.completions.create(model=path, messages=chat_messages(source), max_tokens=12,
                                                   temperature=0, extra_body={"ignore_eos": True})
            assert reply.choices[0].message.content == expected, source[:30]
        big = "data:image/png;base64," + base64.b64encode(bytes(30000)).decode()
        for source, words in (("data:image/png;base64,AAAA", "cannot be decoded"),
                              ("data:image/png;base64,@@", "base64"),
                              ("data:text/plain;base64,AAAA", "data URL of an image"), (big, "--max-image-bytes"),
                              (base + "/big.png", "--max-image-bytes"), (base + "/missing.png", "HTTP 404"),
                              (base + "/redirect", "HTTP 302"), ("http://127.0.0.1:9/x.png", "could not be fetched"),
                              (f"http://localhost:{files.server_port}/cat.png", "not among the server's")):
            body = {"model": path, "messages": chat_messages(source), "max_tokens": 4}
            message = error_of(http(server, "POST", "/v1/chat/completions", json=body), 400)["message"]
            assert words in message, (source[:40], message)
        assert httpx.get(server.url + "/health").status_code == 200
        again = client.chat.completions.create(model=path, messages=chat_messages(url), max_tokens=12,
                                               temperature=0, extra_body={"ignore_eos": True})
        assert again.choices[0].message.content == expected
        assert server.metrics().get("nanovllm:num_requests_running", 0) == 0
    finally:
        files.shutdown()
        assert server.stop() == 0, server.log()

"""Image input (issue 49): what the engine adds for a model that takes images (Qwen2.5-VL and
Qwen3-VL, models/qwen2_5_vl.py and qwen3_vl.py). A request brings its images beside its prompt, the vLLM way:

    llm.generate([{"prompt": "<|vision_start|><|image_pad|><|vision_end|>What is this?",
                   "multi_modal_data": {"image": pil_image}}], params)

(or "prompt_token_ids"; "image" one image or a list: PIL images, numpy arrays, tensors). The path:

  request      the model's own Hugging Face image processor turns each image into patches and
               their grid; each placeholder token (one per image, in order) is expanded into the
               image's number of tokens (its merged grid's size); the prompt's three M-RoPE
               positions per token are computed once (mrope_positions), and its position delta
               (after the last image, positions run behind token indices by it)
  prefix cache a MultimodalSequence's block tokens have each placeholder token replaced by its
               image's key (a 63-bit xxh64 of its patches and grid, negated: never a token id), so
               the chained block hashes, and the tokens a hit verifies, include the images: the same
               text with another image shares no block, the same image and text hits
  a step       MultimodalScheduledStep.batch() adds each token's three positions and the image
               spans its prefill chunks hold; the runner encodes the images it has not encoded yet
               (the vision tower, all of a step's new images in one call; Qwen3-VL's DeepStack
               features ride beside the embeddings, token by token), keeps their embeddings by
               key until a request has consumed an image's last placeholder (so a chunked prefill
               over an image encodes it once), and hands the model the step's positions and the
               embeddings of its placeholder tokens (model.multimodal_step)

Tensor parallelism: every rank holds the whole vision tower and encodes a step's images itself
(the step's message carries their patches); the text decoder is split as always.

Chat: LLM.chat and the server read OpenAI's image_url content parts (chat_images: data URLs here;
the server's entrypoints/media.py fetches allowed http(s) ones).

Layers of other kinds: over the state cache (Qwen3.5 with images) the two layers' classes combine
(features/multimodal_state.py); the prefix cache's hits end at a state snapshot there as ever.

CUDA graphs: a captured decode step rotates by its rows' token positions, so a decode step holding
a sequence with images (whose M-RoPE positions run behind its token positions by its delta) runs
eagerly; a step of text alone replays its graph.

Encoder budget: the images a step starts hold at most max_num_batched_tokens tokens
(MultimodalScheduler), one larger than that alone.

Not here yet (the issue's rest): pipeline parallelism, speculative decoding, sliding-window layers
with images, video.
"""
import base64
import binascii
import functools
import io
from collections import OrderedDict
from dataclasses import dataclass, field, fields

import numpy as np
import torch
import xxhash

from nanovllm.engine.model_runner import ModelRunner
from nanovllm.engine.scheduler import ScheduledStep, Scheduler
from nanovllm.engine.sequence import Sequence
from nanovllm.engine.step_batch import StepBatch
from nanovllm.models import resolve_model_class
from nanovllm.models.qwen2_5_vl import MultimodalStep
from nanovllm.utils.context import to_device

PROMPT_KEYS = ("prompt", "prompt_token_ids", "multi_modal_data")
ENCODED_IMAGES = 64  # image embeddings kept at most (an aborted request's are dropped least recently used first)


@dataclass
class ImageInput:
    """One image of a prompt: its patches (the processor's), their grid of patches (t, h, w), its
    placeholder tokens in the prompt (offset, length) and its key."""
    pixel_values: torch.Tensor
    grid_thw: tuple[int, int, int]
    offset: int
    length: int
    key: int


class MultimodalPrompt(list):
    """A prompt's token ids (placeholders expanded), with its images and M-RoPE positions [3, n]
    and delta; the engine makes it a MultimodalSequence (`sequence_class`)."""

    def __init__(self, ids: list[int], images: list[ImageInput], positions: np.ndarray, delta: int):
        super().__init__(ids)
        self.images, self.positions, self.delta = images, positions, delta

    @property
    def sequence_class(self):
        return MultimodalSequence


class MultimodalSequence(Sequence):
    """A Sequence whose prompt holds images: their keys in its block tokens, M-RoPE positions."""
    __slots__ = ("images", "mrope_positions", "mrope_delta")

    def __init__(self, prompt: MultimodalPrompt, *args, **kwargs):
        super().__init__(prompt, *args, **kwargs)
        self.images, self.mrope_positions, self.mrope_delta = prompt.images, prompt.positions, prompt.delta

    def images_in(self, start: int, end: int):
        """(image, first, end) for each image with placeholder tokens in [start, end): those tokens."""
        for image in self.images:
            first, last = max(start, image.offset), min(end, image.offset + image.length)
            if first < last:
                yield image, first, last

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        start = i * block_size
        tokens = self.token_ids[start:start + block_size]
        for image, first, end in self.images_in(start, start + block_size):
            tokens[first - start:end - start] = [-1 - image.key] * (end - first)
        return tokens

    def rope_positions(self, start: int, n: int) -> np.ndarray:
        """[3, n] int64: the M-RoPE positions of tokens start .. start + n - 1."""
        prompt = self.mrope_positions.shape[1]
        inside = self.mrope_positions[:, start:min(start + n, prompt)]
        after = max(start, prompt)  # (the completion's tokens, if the span reaches them)
        return np.concatenate([inside, text_positions(after + self.mrope_delta, max(0, start + n - after))], 1)


def text_positions(start: int, n: int) -> np.ndarray:
    """[3, n]: n text tokens' M-RoPE positions from start, the same in all three grids."""
    return np.broadcast_to(np.arange(start, start + n), (3, n))


# ---- requests ----------------------------------------------------------------------------------
class ImageProcessing:
    """A checkpoint's image side: its image processor, placeholder token and merge size."""

    def __init__(self, model: str):
        from transformers import AutoConfig, AutoImageProcessor
        config = AutoConfig.from_pretrained(model)
        if getattr(config, "vision_config", None) is None:
            raise ValueError(f"{model!r} takes no images (its config has no vision_config)")
        self.image_token_id = config.image_token_id
        self.merge = config.vision_config.spatial_merge_size
        try:  # (the PIL processor: the torchvision one, or AutoProcessor's video processor, would need torchvision)
            self.processor = AutoImageProcessor.from_pretrained(model, backend="pil")
        except (OSError, ValueError) as e:
            raise ValueError(f"cannot load the image processor of {model!r} (preprocessor_config.json): {e}") from e

    def image(self, image, offset: int) -> ImageInput:
        """One image as patches, or a ValueError saying what is wrong with it."""
        try:
            out = self.processor(images=[image], return_tensors="pt")
        except Exception as e:  # (the processor's own errors: a shape or dtype it cannot read)
            raise ValueError(f"cannot process the image: {type(e).__name__}: {e}") from e
        pixels, (grid,) = out["pixel_values"].float(), out["image_grid_thw"].tolist()
        digest = xxhash.xxh64(pixels.numpy().tobytes())
        digest.update(np.asarray(grid, dtype=np.int64).tobytes())
        return ImageInput(pixels, tuple(grid), offset, grid[0] * grid[1] * grid[2] // self.merge ** 2,
                          digest.intdigest() >> 1)


@functools.cache
def image_processing(model: str) -> ImageProcessing:
    return ImageProcessing(model)


def images_for(config) -> ImageProcessing:
    """The engine's model's image side, or a ValueError when it takes no images (a text model, or a
    multimodal checkpoint whose vision tower the engine does not run: Gemma 3's)."""
    if not getattr(resolve_model_class(config.hf_config), "takes_images", False):
        raise ValueError(f"{config.model!r} takes no images here ({config.hf_config.architectures[0]} runs its text "
                         f"alone); the models that do: Qwen2.5-VL, Qwen3-VL, Qwen3.5")
    return image_processing(config.model)


def encode_multimodal(frontend, prompt: dict) -> list[int]:
    """A dict prompt {"prompt" or "prompt_token_ids", "multi_modal_data": {"image": ...}} as token
    ids (a MultimodalPrompt when it has images), or a TypeError / ValueError naming the problem."""
    unknown = sorted(set(prompt) - set(PROMPT_KEYS))
    if unknown:
        raise ValueError(f"a prompt dict takes the keys {list(PROMPT_KEYS)}, got {unknown}")
    if ("prompt" in prompt) == ("prompt_token_ids" in prompt):
        raise ValueError("a prompt dict needs exactly one of 'prompt' (text) and 'prompt_token_ids'")
    ids = frontend.encode_prompt(prompt["prompt"] if "prompt" in prompt else list(prompt["prompt_token_ids"]))
    data = prompt.get("multi_modal_data") or {}
    if not isinstance(data, dict) or set(data) - {"image"}:
        raise ValueError(f"multi_modal_data takes {{'image': an image or a list of them}}, got "
                         f"{sorted(data) if isinstance(data, dict) else type(data).__name__}")
    images = data.get("image")
    images = [] if images is None else list(images) if isinstance(images, (list, tuple)) else [images]
    if not images:
        return ids
    from PIL import Image
    for image in images:
        if not isinstance(image, (Image.Image, np.ndarray, torch.Tensor)):
            raise TypeError(f"an image must be a PIL image, a numpy array or a tensor, got {type(image).__name__}")
    return expand_images(images_for(frontend.config), ids, images, frontend.config.max_model_len)


def expand_images(processing: ImageProcessing, ids: list[int], images: list, max_model_len: int) -> MultimodalPrompt:
    """ids with each placeholder token (one per image) expanded into its image's tokens."""
    places = [i for i, t in enumerate(ids) if t == processing.image_token_id]
    if len(places) != len(images):
        raise ValueError(f"the prompt has {len(places)} image placeholder tokens (id {processing.image_token_id}) "
                         f"for {len(images)} images: put one where each image goes, in order")
    expanded, inputs, last = [], [], 0
    for place, image in zip(places, images):
        expanded += ids[last:place]
        item = processing.image(image, len(expanded))
        expanded += [processing.image_token_id] * item.length
        inputs.append(item)
        last = place + 1
    expanded += ids[last:]
    if len(expanded) >= max_model_len:
        raise ValueError(f"the prompt has {len(expanded)} tokens with its images' ({sum(i.length for i in inputs)}), "
                         f"which leaves no room to generate within max_model_len={max_model_len}")
    positions = mrope_positions(len(expanded), inputs, processing.merge)
    return MultimodalPrompt(expanded, inputs, positions, int(positions.max()) + 1 - len(expanded))


def mrope_positions(num_tokens: int, images: list[ImageInput], merge: int) -> np.ndarray:
    """[3, num_tokens] int64, as transformers' get_rope_index for images: text tokens count on in
    all three grids; an image's tokens sit at (start, start + row, start + column) of its merged
    grid, and the text after it starts at start + max(rows, columns)."""
    pieces, position, cursor = [], 0, 0
    for image in images:
        text = image.offset - cursor
        pieces.append(text_positions(position, text))
        position += text
        t, h, w = image.grid_thw[0], image.grid_thw[1] // merge, image.grid_thw[2] // merge
        grids = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
        pieces.append(np.stack(grids).reshape(3, -1) + position)
        position += max(h, w)
        cursor = image.offset + image.length
    pieces.append(text_positions(position, num_tokens - cursor))
    return np.concatenate(pieces, 1).astype(np.int64)


# ---- chat messages -----------------------------------------------------------------------------
def chat_images(frontend, messages: list[dict], load_url=None) -> tuple[list[dict], list]:
    """OpenAI-style messages whose content parts may hold images ({"type": "image_url", "image_url":
    {"url": a data URL}}, or {"type": "image", "image": an image} offline) -> the messages as a chat
    template takes them (each image part {"type": "image"}, which the Qwen-VL templates render as
    the image's placeholder), and the images in order. load_url(url, where) reads an image_url
    (default image_from_url: data URLs; the server's entrypoints/media.py fetches allowed http(s)
    ones too). A ValueError names a bad part, or a model that takes no images (before any is read)."""
    images_for(frontend.config)
    rendered, images = [], []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            rendered.append(message)
            continue
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                image_url = part.get("image_url")
                url = image_url.get("url") if isinstance(image_url, dict) else None
                images.append((load_url or image_from_url)(url, f"messages[{i}].content[{j}]"))
            elif kind == "image":
                images.append(part.get("image"))
            else:
                parts.append(part)
                continue
            parts.append({"type": "image"})
        rendered.append({**message, "content": parts})
    return rendered, images


def image_from_url(url, where: str):
    """A data URL's image as an RGB PIL image (offline: an http(s) URL is refused), or a ValueError."""
    if isinstance(url, str) and url.startswith(("http://", "https://")):
        raise ValueError(f"{where}: image URLs over http(s) are not fetched here; send the image as a data URL "
                         f"(data:image/png;base64,...), or serve with --allowed-media-domains")
    return decode_image(data_url_bytes(url, where), where)


def data_url_bytes(url, where: str) -> bytes:
    """The bytes of a base64 data URL of an image (data:image/...;base64,...), or a ValueError."""
    if not isinstance(url, str):
        raise ValueError(f"{where}: an image_url part needs {{'url': a string}}")
    header, comma, data = url.partition(",")
    if not (url.startswith("data:image/") and comma and header.endswith(";base64")):
        raise ValueError(f"{where}: an image URL must be a base64 data URL of an image (data:image/...;base64,...), "
                         f"got one starting {url[:40]!r}")
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{where}: the data URL's base64 is not valid: {e}") from e


def decode_image(raw: bytes, where: str):
    """Image bytes as an RGB PIL image, or a ValueError: not an image Pillow reads, or too many pixels."""
    from PIL import Image
    try:
        with Image.open(io.BytesIO(raw)) as image:
            return image.convert("RGB")
    except Image.DecompressionBombError as e:
        raise ValueError(f"{where}: the image has too many pixels: {e}") from e
    except (OSError, ValueError, SyntaxError) as e:  # (UnidentifiedImageError is an OSError)
        raise ValueError(f"{where}: the image cannot be decoded: {e}") from e


# ---- steps -------------------------------------------------------------------------------------
def multimodal_classes(config, runner_class: type, scheduler_class: type, block_manager_class: type
                       ) -> tuple[type, type, type]:
    """The runner, scheduler and block manager of a model that takes images, over the plain ones
    (tensor-parallel ranks too; over the state cache's: features/multimodal_state.py), or a
    ValueError for an option they do not support yet."""
    if runner_class is not ModelRunner or scheduler_class is not Scheduler:
        raise ValueError("image input is not supported yet with speculative decoding, pipeline parallelism or "
                         "sliding-window layers")
    return MultimodalRunner, MultimodalScheduler, block_manager_class


@dataclass
class MultimodalStepBatch(StepBatch):
    """A step's message, with its M-RoPE positions [3, T] (None: no sequence with images) and the
    image spans of its prefill chunks: (flat index of the first token, image, its first token, n)."""
    rope_positions: np.ndarray | None = None
    image_spans: list[tuple[int, ImageInput, int, int]] = field(default_factory=list)


@dataclass
class MultimodalScheduledStep(ScheduledStep):
    Batch = MultimodalStepBatch  # (its message: a MultimodalStepBatch of the base step's batch)

    def batch(self) -> MultimodalStepBatch:
        plain = super().batch()
        batch = self.Batch(**{f.name: getattr(plain, f.name) for f in fields(plain)})
        if not any(isinstance(seq, MultimodalSequence) for seq in self.seqs):
            return batch  # (text alone: the plain positions are M-RoPE's)
        positions, flat = [], 0
        for seq, start, n in zip(self.seqs, self.starts, self.num_new):
            if not isinstance(seq, MultimodalSequence):
                positions.append(text_positions(start, n))
            else:
                positions.append(seq.rope_positions(start, n))
                for image, first, end in seq.images_in(start, start + n):
                    batch.image_spans.append((flat + first - start, image, first - image.offset, end - first))
            flat += n
        batch.rope_positions = np.concatenate(positions, 1)
        return batch


class MultimodalScheduler(Scheduler):
    """The scheduler, with an encoder budget per step: the images a step's chunks start (encoded in
    that step) hold at most max_num_batched_tokens tokens together, so that the vision tower's work
    in one step is bounded as the decoder's is. A chunk that would start an image past the budget
    ends before it; an image larger than the whole budget is encoded alone, in a step that starts
    no other.

    encoder_budget  image tokens the step being planned may still start"""
    Step = MultimodalScheduledStep

    def schedule(self):
        self.encoder_budget = self.max_num_batched_tokens
        return super().schedule()

    def _schedule_one(self, step, seq, budget: int, admitted: bool, num_drafts: int = 0) -> int:
        if isinstance(seq, MultimodalSequence):
            budget = self._within_encoder_budget(seq, seq.num_computed_tokens, budget, admitted)
            if budget == 0:
                return -1  # (its next image waits for a step with room; the step takes no later sequence)
        return super()._schedule_one(step, seq, budget, admitted, num_drafts)

    def _within_encoder_budget(self, seq: "MultimodalSequence", start: int, budget: int, admitted: bool) -> int:
        """budget, cut before the first image the chunk from start would start past the encoder budget
        (0 if that image is the chunk's first token); the images it encodes taken from the budget:
        those it starts, and, just admitted, one a prefix-cache hit left it inside of."""
        end = min(seq.num_tokens, start + budget)
        for image in seq.images:
            starts = start <= image.offset < end
            if not (starts or (admitted and image.offset < start < image.offset + image.length)):
                continue
            if image.length > self.encoder_budget and self.encoder_budget < self.max_num_batched_tokens:
                return max(image.offset - start, 0)
            self.encoder_budget -= image.length
        return budget


class MultimodalRunner(ModelRunner):
    """The model runner, with the vision tower built and each step's images encoded and handed to the model.

    encoded  {image key: its embeddings [tokens, hidden]} until a step consumes its last token"""

    def __init__(self, *args, **kwargs):
        self.encoded: OrderedDict[int, torch.Tensor] = OrderedDict()
        super().__init__(*args, **kwargs)

    def _build_model(self, model_class: type):
        from transformers import AutoConfig
        vision_config = AutoConfig.from_pretrained(self.config.model).vision_config
        return super()._build_model(lambda config, max_position: model_class(config, max_position, vision_config))

    def prepare(self, batch: MultimodalStepBatch, graphs):
        # A captured decode step rotates by its rows' token positions: one holding a sequence with
        # images (whose M-RoPE positions run behind by its delta) runs eagerly; text alone replays.
        inputs = super().prepare(batch, graphs if batch.rope_positions is None else None)
        if inputs is None:
            return None
        step = None
        if batch.rope_positions is not None:
            step = MultimodalStep(to_device(np.ascontiguousarray(batch.rope_positions), self.device))
            if batch.image_spans:
                step.embeddings, step.slots = self._image_embeddings(batch.image_spans)
        self.model.multimodal_step = step
        return inputs

    def _image_embeddings(self, spans) -> tuple[torch.Tensor, torch.Tensor]:
        """The embeddings of the spans' tokens and their flat indices, encoding the images not kept yet."""
        new = list({image.key: image for _, image, _, _ in spans if image.key not in self.encoded}.values())
        if new:
            grids = torch.tensor([image.grid_thw for image in new], device=self.device)
            pixels = torch.cat([image.pixel_values for image in new]).to(self.device)
            with torch.inference_mode():
                out = self.model.encode_images(pixels, grids)
            for image, embeddings in zip(new, out.split([image.length for image in new])):
                self.encoded[image.key] = embeddings
        embeddings, slots, consumed = [], [], set()
        for flat, image, first, n in spans:
            self.encoded.move_to_end(image.key)
            embeddings.append(self.encoded[image.key][first:first + n])
            slots.append(np.arange(flat, flat + n))
            if first + n == image.length:  # (its last token: the request has consumed it)
                consumed.add(image.key)
        for key in consumed:
            del self.encoded[key]
        while len(self.encoded) > ENCODED_IMAGES:
            self.encoded.popitem(last=False)
        return torch.cat(embeddings), to_device(np.concatenate(slots), self.device)

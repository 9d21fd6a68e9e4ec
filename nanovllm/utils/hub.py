"""A model named by a folder or a Hugging Face Hub repository id, as a local folder."""
import os
import re

from huggingface_hub import snapshot_download

# A Hugging Face Hub repository id: "Qwen/Qwen3-0.6B" (or a bare "gpt2"), not a path
REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w][\w.-]*)?")
HUB_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]  # config, weights, tokenizer


def resolve_model(name, what: str = "model") -> str:
    """A model's local folder: `name` itself when it is one; else the snapshot of the Hugging Face
    Hub repository of that id (its config, weights and tokenizer files; downloaded into the Hub
    cache, or found there when offline, as vLLM does). A ValueError when it is neither."""
    if not isinstance(name, (str, os.PathLike)):
        raise TypeError(f"{what} must be a path to a Hugging Face model folder or a Hub repository id, got {name!r}")
    name = os.fspath(name)
    if os.path.isdir(name):
        return name
    if os.path.isabs(name) or name.startswith(".") or not REPO_ID.fullmatch(name):
        raise ValueError(f"{what} folder {name!r} does not exist")
    try:
        return snapshot_download(name, allow_patterns=HUB_FILES)
    except Exception as online:  # no network, an unknown repository, a gated one: try the cache alone
        try:
            return snapshot_download(name, allow_patterns=HUB_FILES, local_files_only=True)
        except Exception:
            raise ValueError(f"{what} {name!r} does not exist as a folder, and the Hugging Face Hub repository of that "
                             f"name could not be fetched or found in the local cache: {online}") from online

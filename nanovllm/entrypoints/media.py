"""Images by URL, for the server's image_url content parts: a data URL always; an http(s) URL only
from the hosts --allowed-media-domains names (a host, or any host under it), fetched with a size
limit (--max-image-bytes, which holds for data URLs too) and a time limit for the whole transfer
(--image-fetch-timeout), no redirect followed (one could lead out of the allowed domains). Every
failure is a ValueError saying which, that the server answers with a 400."""
import time
from dataclasses import dataclass
from urllib.parse import urlsplit


DEFAULT_MAX_IMAGE_BYTES = 5 * 2**20
DEFAULT_FETCH_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class ImageURLs:
    allowed_domains: tuple[str, ...] = ()
    max_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    timeout_s: float = DEFAULT_FETCH_TIMEOUT_S

    def load(self, url, where: str):
        """The image at url (features/multimodal.chat_images's `load_url`) as an RGB PIL image."""
        from nanovllm.features.multimodal import data_url_bytes, decode_image  # (image input's: loaded when used)
        if isinstance(url, str) and url.startswith(("http://", "https://")):
            return decode_image(self.fetch(url, where), where)
        raw = data_url_bytes(url, where)
        self._check_size(len(raw), where)
        return decode_image(raw, where)

    def allows(self, host: str | None) -> bool:
        return host is not None and any(host == d or host.endswith("." + d) for d in self.allowed_domains)

    def fetch(self, url: str, where: str) -> bytes:
        import httpx
        host = urlsplit(url).hostname
        if not self.allows(host):
            allowed = ", ".join(self.allowed_domains) or "none: http(s) image URLs are off; send data URLs"
            raise ValueError(f"{where}: the image's host {host!r} is not among the server's --allowed-media-domains "
                             f"({allowed})")
        deadline, chunks, size = time.monotonic() + self.timeout_s, [], 0
        try:
            with httpx.stream("GET", url, timeout=self.timeout_s, follow_redirects=False) as response:
                if response.status_code != 200:
                    raise ValueError(f"{where}: fetching the image gave HTTP {response.status_code}")
                declared = response.headers.get("content-length", "")
                if declared.isdigit():
                    self._check_size(int(declared), where)
                for chunk in response.iter_bytes():
                    size += len(chunk)
                    self._check_size(size, where)
                    if time.monotonic() > deadline:
                        raise httpx.TimeoutException(f"over {self.timeout_s:g} s")
                    chunks.append(chunk)
        except httpx.HTTPError as e:
            raise ValueError(f"{where}: the image could not be fetched ({type(e).__name__}: {e}); "
                             f"--image-fetch-timeout is {self.timeout_s:g} s") from e
        return b"".join(chunks)

    def _check_size(self, size: int, where: str):
        if size > self.max_bytes:
            raise ValueError(f"{where}: the image is larger than the {self.max_bytes} bytes --max-image-bytes allows")

"""What the server tests share: `python -m nanovllm serve` as a subprocess on a free loopback port,
raw HTTP calls with or without the key, and the checks of an error's OpenAI shape."""
import os
import signal
import socket
import subprocess
import sys
import time

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEY = "test-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m nanovllm serve` in a subprocess, its output in a log file."""

    def __init__(self, model: str, log_path, *flags: str, max_model_len: int = 2048, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        environment = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        environment.pop("NANOVLLM_API_KEY", None)
        environment.update(env or {})
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "nanovllm", "serve", model, "--port", str(self.port),
                 "--max-model-len", str(max_model_len), *flags], stdout=log, stderr=subprocess.STDOUT,
                env=environment)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise RuntimeError(f"the server did not become healthy:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.url + "/metrics").text
        return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines() if line.startswith("nanovllm:")}

    def stop(self, timeout: float = 10) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return self.proc.returncode


def module_server(model: str, tmp_path_factory, *flags: str, max_model_len: int):
    """A test module's server (for a module-scoped fixture to `yield from`): started, handed over,
    and checked to exit with status 0 when the module is done."""
    server = Server(model, tmp_path_factory.mktemp("log") / "server.log", *flags, max_model_len=max_model_len)
    yield server
    assert server.stop() == 0, server.log()


def chat_server(tmp_path_factory, name: str, *flags: str, max_model_len: int = 1024):
    """module_server() of a tiny chat model (ChatML template, tools included) served as `name`
    behind KEY, for the API-feature test modules."""
    from nanovllm.utils.tiny_model import build_model
    model = build_model(str(tmp_path_factory.mktemp(name)), chat_template=True)
    yield from module_server(model, tmp_path_factory, "--api-key", KEY, "--served-model-name", name, *flags,
                             max_model_len=max_model_len)


def openai_client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)


def http(server, method: str, path: str, key: str | None = KEY, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.request(method, server.url + path, headers=headers, timeout=30, **kwargs)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


def wait_for(condition, timeout: float = 30.0) -> bool:
    """Whether `condition()` comes true within `timeout` seconds (polled). Generous: it returns as
    soon as the condition holds, and a loaded machine can take seconds for what takes milliseconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()

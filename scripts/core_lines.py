"""The lines of nanovllm a plain generate loads: the modules a greedy `LLM(path).generate()` on a
dense model imports (on CPU, in a fresh interpreter), each with its line count, and their total.
What a reader of one request's path must read, and what the core's size budget counts.

    python scripts/core_lines.py                  # every module and the total
    python scripts/core_lines.py --max-lines 6000 # exit status 1 above it (tests/test_core_size.py)

The model is a tiny random-weight Qwen3 with a tokenizer, built in a process of its own first (so
that the building, utils/tiny_model.py, is not counted).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

BUILD = "import sys; from nanovllm.utils.tiny_model import build_model; build_model(sys.argv[1])"
GENERATE = """
import json, sys
from nanovllm import LLM, SamplingParams
with LLM(sys.argv[1], max_model_len=64) as llm:
    llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
print(json.dumps({name: module.__file__ for name, module in sys.modules.items()
                  if name.split(".")[0] == "nanovllm" and getattr(module, "__file__", None)}))
"""


def loaded_modules(model: str) -> dict[str, int]:
    """{module name: lines} of the nanovllm modules a plain generate on `model` imports."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-c", GENERATE, model], env=env, capture_output=True, text=True, check=True)
    files = json.loads(out.stdout.strip().splitlines()[-1])
    return {name: sum(1 for _ in open(path, encoding="utf-8")) for name, path in sorted(files.items())}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-lines", type=int, default=None, help="exit 1 if the total is above this")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        subprocess.run([sys.executable, "-c", BUILD, folder], env=env, check=True, capture_output=True)
        modules = loaded_modules(folder)
    for name, lines in modules.items():
        print(f"{lines:6d}  {name}")
    total = sum(modules.values())
    print(f"{total:6d}  lines in {len(modules)} modules (a plain dense-model generate on CPU)")
    if args.max_lines is not None and total > args.max_lines:
        print(f"over the budget of {args.max_lines} lines", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

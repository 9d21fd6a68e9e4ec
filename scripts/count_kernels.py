"""The kernels one decode step dispatches, per decoder layer and in all, with the CUDA path's modules.

A kernel is a dispatched aten op that computes (views and allocations launch nothing and are not
counted) or a Triton kernel launch (one count each, whatever it does inside). The step runs eagerly
(enforce_eager: a CUDA graph replays the same kernels, so it has as many nodes), with the Triton
attention backend: on a GPU compiled, on CPU under Triton's interpreter (slow: use few layers).

    python scripts/count_kernels.py                              # qwen3-0.6b, bf16, 4 sequences, on CUDA if there
    python scripts/count_kernels.py --device cpu --num-layers 2  # what tests/test_count_kernels.py runs
    python scripts/count_kernels.py --ops                        # ... and which ops a layer runs
    python scripts/count_kernels.py --max-per-layer 15           # exit status 1 above it (gpu_check.sh)

A layer's kernels are those dispatched between its forward's start and end; the rest of the step
(the embedding, the final norm, the LM head, the sampler, the step's input gathering) is "outside".
"""
import argparse
import collections
import contextlib
import json
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

# aten ops that launch nothing: allocations, and metadata-only ops that torch does not tag as views
NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "_local_scalar_dense",
             "lift_fresh", "is_same_size", "_has_compatible_shallow_copy_type", "set_", "resize_", "sym_size",
             "sym_stride", "sym_numel", "sym_storage_offset"}


def _storages(value) -> set[int]:
    """The data pointers of the storages of the tensors in value (a tensor, or a list or tuple of them)."""
    tensors = value if isinstance(value, (list, tuple)) else [value]
    return {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, torch.Tensor)}


class KernelCounter(TorchDispatchMode):
    """Counts kernels by the label in `where` (set by the layers' hooks), and by op under each label."""

    def __init__(self):
        super().__init__()
        self.where = "outside"
        self.counts = collections.Counter()
        self.ops = collections.defaultdict(collections.Counter)
        self.in_triton = 0  # (the interpreter's own tensor work inside a launch is the launch)
        self.active = False  # (Triton launches are counted through a patch: only inside `with counter`)

    def __enter__(self):
        self.active = True
        return super().__enter__()

    def __exit__(self, *exc_info):
        self.active = False
        return super().__exit__(*exc_info)

    def note(self, name: str):
        if self.active and not self.in_triton:
            self.counts[self.where] += 1
            self.ops[self.where][name] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        out = func(*args, **(kwargs or {}))
        # a view launches nothing, unless it is one only when it can be (`to` of another dtype copies)
        if func.is_view:
            if _storages(out) - _storages(args):
                self.note(f"aten.{name}")
        elif name not in NO_KERNEL:
            self.note(f"aten.{name}")
        return out


@contextlib.contextmanager
def count_triton_launches(counter: KernelCounter):
    """Triton's launch paths (compiled and interpreted) patched to count each launch as one kernel."""
    from triton.runtime import interpreter, jit

    def counted(run):
        def launch(self, *args, **kwargs):
            counter.note(f"triton.{getattr(self, '__name__', None) or self.fn.__name__}")
            counter.in_triton += 1
            try:
                return run(self, *args, **kwargs)
            finally:
                counter.in_triton -= 1
        return launch

    originals = jit.JITFunction.run, interpreter.InterpretedFunction.run
    jit.JITFunction.run, interpreter.InterpretedFunction.run = map(counted, originals)
    try:
        yield
    finally:
        jit.JITFunction.run, interpreter.InterpretedFunction.run = originals


def count(preset: str, device: str, num_layers: int | None, num_seqs: int, dtype: str) -> dict:
    """One pure-decode step of num_seqs sequences: kernels per layer, outside the layers, in all."""
    import bench
    from nanovllm import LLM, SamplingParams
    path = bench.write_dummy_config(preset)
    if num_layers is not None:  # (fewer layers: the per-layer count is the same)
        config_file = os.path.join(path, "config.json")
        with open(config_file) as f:
            config = json.load(f)
        config["num_hidden_layers"] = num_layers
        if "layer_types" in config:
            config["layer_types"] = config["layer_types"][:num_layers]
        with open(config_file, "w") as f:
            json.dump(config, f)
    llm = LLM(path, device=device, dtype=dtype, load_format="dummy", attention_backend="triton", enforce_eager=True,
              max_model_len=256, max_num_seqs=num_seqs, num_kvcache_blocks=num_seqs * 16 + 1, kvcache_block_size=16)
    counter = KernelCounter()
    layers = llm.model_runner.model.model.layers
    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(lambda module, args, i=i: setattr(counter, "where", f"layer {i}"))
        layer.register_forward_hook(lambda module, args, out: setattr(counter, "where", "outside"))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for j in range(num_seqs):
        llm.add_request([1 + j] * (20 + j), params)
    while not all(seq.num_computed_tokens > seq.num_prompt_tokens for seq in llm.scheduler.running) \
            or len(llm.scheduler.running) < num_seqs:
        llm.step()  # (the prefills, and a first decode: every later step is a pure decode)
    llm.step()
    with count_triton_launches(counter), counter:
        llm.step()
    llm.shutdown()
    per_layer = [counter.counts[f"layer {i}"] for i in range(len(layers))]
    return {"preset": preset, "device": device, "dtype": dtype, "num_layers": len(layers), "num_seqs": num_seqs,
            "per_layer": per_layer, "outside": counter.counts["outside"], "total": sum(counter.counts.values()),
            "layer_ops": dict(counter.ops["layer 0"].most_common()), "outside_ops": dict(counter.ops["outside"].most_common())}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="qwen3-0.6b")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--num-layers", type=int, help="override the preset's layer count (CPU: the interpreter is slow)")
    p.add_argument("--num-seqs", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--ops", action="store_true", help="also list the ops of layer 0 and outside the layers")
    p.add_argument("--max-per-layer", type=int, help="exit status 1 if a layer launches more kernels")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = count(args.preset, args.device, args.num_layers, args.num_seqs, args.dtype)
    layer = result["per_layer"]
    print(f"{args.preset} ({result['num_layers']} layers, {args.dtype}, {args.device}), decode step of "
          f"{args.num_seqs} sequences: {layer[0]} kernels per layer"
          + ("" if len(set(layer)) == 1 else f" (layers: {layer})")
          + f", {result['outside']} outside the layers, {result['total']} in all")
    if args.ops:
        for where in ("layer_ops", "outside_ops"):
            print(f"  {where.split('_')[0]}: " + ", ".join(f"{op} {n}" for op, n in result[where].items()))
    result["over_limit"] = args.max_per_layer is not None and max(layer) > args.max_per_layer
    if result["over_limit"]:
        print(f"  over the limit of {args.max_per_layer} kernels per layer")
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    sys.exit(1 if main()["over_limit"] else 0)

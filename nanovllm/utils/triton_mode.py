"""Triton's mode, compiled (CUDA tensors) or interpreted (CPU tensors), which is one per process.

TRITON_INTERPRET is read when `triton` is first imported, which builds triton.language's helpers
(tl.cdiv, ...) as interpreted or compiled functions, and again as each @triton.jit kernel is defined.
Neither can be rebuilt, and the kinds do not mix (an interpreted kernel calling a compiled tl.cdiv
fails with "Cannot call @triton.jit'd outside of the scope of a kernel"). So the first user of Triton
in the process picks the mode, and a later user that needs the other is refused here, at start-up
with the reason. (Compiled kernels cannot read CPU tensors; interpreted ones copy CUDA tensors to the
host and back at every launch: slow, and no CUDA-graph capture.)
"""
import functools
import importlib
import os
import sys

# The class names of a @triton.jit function in each mode (triton.runtime.jit / .interpreter).
COMPILED, INTERPRETED = "JITFunction", "InterpretedFunction"


def _jit_kinds(namespace) -> set[str]:
    return {type(value).__name__ for value in vars(namespace).values()} & {COMPILED, INTERPRETED}


@functools.cache
def import_kernels(module_name: str, device: str, user: str):
    """Import `module_name` (which defines @triton.jit kernels) for tensors on `device`, or raise
    ValueError when this process's Triton runs in the other mode (`user`: what needs the kernels).
    Cached: the fused MoE layer asks at every forward."""
    interpret = device == "cpu"
    if interpret and "triton" not in sys.modules:
        # Process-wide on purpose (see above): this process's Triton is now the interpreter.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    module = importlib.import_module(module_name)
    import triton.language as tl
    library, kernels = _jit_kinds(tl.standard), _jit_kinds(module)
    if len(library | kernels) > 1:
        raise ValueError(f"triton.language's functions and the kernels of {module_name} were built in different "
                         f"Triton modes (TRITON_INTERPRET changed between importing triton and importing "
                         f"{module_name}; it is now {os.environ.get('TRITON_INTERPRET')!r}): {user} cannot run "
                         f"in this process; set TRITON_INTERPRET (or not) before anything imports triton")
    interpreted = (library | kernels) == {INTERPRETED}
    if interpreted == interpret:
        return module
    if interpret:
        raise ValueError(f"{user} on device='cpu' runs its Triton kernels under Triton's interpreter, but this "
                         f"process already runs Triton compiled (triton was imported without TRITON_INTERPRET=1, "
                         f"e.g. for an engine on device='cuda'), and Triton cannot switch modes within a "
                         f"process: run it in a process of its own, or set TRITON_INTERPRET=1 before anything "
                         f"imports triton")
    raise ValueError(f"{user} on device='cuda' needs compiled Triton kernels, but this process runs Triton under "
                     f"its interpreter (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r} when triton was "
                     f"first imported, e.g. set by an engine with device='cpu' and attention_backend='triton'), "
                     f"and Triton cannot switch modes within a process: run it in a process of its own, without "
                     f"TRITON_INTERPRET")


def check_kernel_device(module_name: str, interpreted: bool, *tensors):
    """ValueError unless the tensors share one device that module_name's kernels can read (CPU when
    interpreted, CUDA when compiled)."""
    device = tensors[0].device
    if any(t.device != device for t in tensors):
        raise ValueError(f"tensors on different devices: {[str(t.device) for t in tensors]}")
    if (device.type == "cpu") != interpreted:
        raise ValueError(f"{module_name}'s kernels were built {'interpreted' if interpreted else 'compiled'} "
                         f"(TRITON_INTERPRET when triton was imported) and cannot run on {device} tensors: "
                         f"CPU tensors need TRITON_INTERPRET=1, CUDA tensors need it unset")

"""The lines of nanovllm a plain generate loads: the modules a greedy `LLM(path).generate()` on a
dense model imports (on CPU, in a fresh interpreter), each with its line count, and their total.
What a reader of one request's path must read, and what the core's size budget counts. Also the
core's long functions, and the import cycles of the whole package (issue 30's other two targets).

    python scripts/core_lines.py                           # every module and the total
    python scripts/core_lines.py --max-lines 6000          # exit status 1 above it (tests/test_core_size.py)
    python scripts/core_lines.py --functions               # the core's functions over 40 lines, longest first
    python scripts/core_lines.py --functions 30            # ... over 30 lines
    python scripts/core_lines.py --max-function-lines 40   # exit status 1 if any is over 40
    python scripts/core_lines.py --cycles                  # the package's import cycles (no generate run)
    python scripts/core_lines.py --no-cycles               # exit status 1 if there is one

The model is a tiny random-weight Qwen3 with a tokenizer, built in a process of its own first (so
that the building, utils/tiny_model.py, is not counted).

A function's length is its `def` line to its last line: its decorators are not counted, its
docstring is. Methods are named Class.method, nested functions outer.<locals>.inner, as Python does.

Cycles are found statically, over every nanovllm/**/*.py (not just the core): an edge for each
import of a nanovllm module, at module level or inside a function (`from nanovllm.x import y`
imports nanovllm.x, and nanovllm.x.y too if that is a module), and for each module loaded by name:
a call of importlib.import_module or of utils/triton_mode.py's import_kernels (which hands its name
to import_module) whose argument is a string, or an f-string or a `+` whose constant start names
modules: an edge to every module that start could resolve to (f"nanovllm.models.{name}": each
module of nanovllm/models). Imports under `if TYPE_CHECKING:` are edges too: they never run, but
they are a dependency all the same, which a reader and a type checker follow (Config importing the
layers that import it for their types was one cycle, issue 46). A
cycle is a strongly connected component of more than one module; a package's __init__ that
imports a submodule which imports the package back (for a name) is one too.
"""
import argparse
import ast
import glob
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = "nanovllm"
LOADERS = ("import_module", "import_kernels")  # calls that import the module their first argument names

BUILD = "import sys; from nanovllm.utils.tiny_model import build_model; build_model(sys.argv[1])"
GENERATE = """
import json, sys
from nanovllm import LLM, SamplingParams
with LLM(sys.argv[1], max_model_len=64) as llm:
    llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
print(json.dumps({name: module.__file__ for name, module in sys.modules.items()
                  if name.split(".")[0] == "nanovllm" and getattr(module, "__file__", None)}))
"""


def _run(code: str, *args: str, **env: str) -> str:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **env}
    return subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                          check=True).stdout


def core_files() -> dict[str, str]:
    """{module name: file} of the nanovllm modules a plain dense-model generate on CPU imports."""
    with tempfile.TemporaryDirectory() as folder:
        _run(BUILD, folder)
        out = _run(GENERATE, folder, CUDA_VISIBLE_DEVICES="")
    return dict(sorted(json.loads(out.strip().splitlines()[-1]).items()))


def line_count(path: str) -> int:
    with open(path, encoding="utf-8") as file:
        return sum(1 for _ in file)


def parse(path: str) -> ast.Module:
    with open(path, encoding="utf-8") as file:
        return ast.parse(file.read(), path)


# --- functions ---------------------------------------------------------------------------------

def functions(node: ast.AST, prefix: str = ""):
    """(qualname, length in lines) of every function and method under an ast node, nested ones too."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + child.name, child.end_lineno - child.lineno + 1  # lineno: the def, not a decorator
            yield from functions(child, f"{prefix}{child.name}.<locals>.")
        elif isinstance(child, ast.ClassDef):
            yield from functions(child, f"{prefix}{child.name}.")
        else:  # an if, a try, a with ... at the same level
            yield from functions(child, prefix)


def long_functions(files: dict[str, str], limit: int) -> dict[str, int]:
    """{module:qualname: length} of the functions of `files` longer than `limit` lines, longest
    first (of two with one name, a property's getter and setter say, the longer)."""
    found: dict[str, int] = {}
    for module, path in files.items():
        for name, length in functions(parse(path)):
            key = f"{module}:{name}"
            if length > limit and length > found.get(key, 0):
                found[key] = length
    return dict(sorted(found.items(), key=lambda item: (-item[1], item[0])))


# --- import cycles -----------------------------------------------------------------------------

def package_files() -> dict[str, str]:
    """{module name: file} of every module of the package, on disk (a package is its __init__.py)."""
    files = {}
    for path in sorted(glob.glob(os.path.join(ROOT, PACKAGE, "**", "*.py"), recursive=True)):
        name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        files[name.removesuffix(".__init__")] = path
    return files


def constant_start(node: ast.expr) -> str | None:
    """The text a string expression is known to start with: all of a constant, the leading
    constant parts of an f-string, the start of a `+`'s left side; None when nothing is known."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        start = ""
        for part in node.values:
            if not isinstance(part, ast.Constant):
                break
            start += part.value
        return start or None
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return constant_start(node.left)
    return None


def loads_by_name(node: ast.AST) -> bool:
    """Whether node is a call of one of LOADERS (by either name or attribute: importlib.import_module)."""
    return (isinstance(node, ast.Call) and bool(node.args)
            and getattr(node.func, "id", getattr(node.func, "attr", None)) in LOADERS)


def named_imports(node: ast.AST, module: str, is_package: bool):
    """The names of modules the code under `node` imports (possibly not nanovllm's), or may load by
    name (a constant start ending in "*"); `if TYPE_CHECKING:` blocks included."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import):
            yield from (alias.name for alias in child.names)
        elif isinstance(child, ast.ImportFrom):
            base = child.module or ""
            if child.level:  # relative: from the package this module is in (or is), up level - 1
                parts = module.split(".")[:len(module.split(".")) - child.level + is_package]
                base = ".".join(parts + ([base] if base else []))
            yield base
            yield from (f"{base}.{alias.name}" for alias in child.names)
        elif loads_by_name(child):
            start = constant_start(child.args[0])
            if start is not None:
                yield start if isinstance(child.args[0], ast.Constant) else start + "*"
        yield from named_imports(child, module, is_package)


def import_graph(files: dict[str, str]) -> dict[str, set[str]]:
    """{module: the package's modules it imports or loads by name}, over `files` (package_files())."""
    graph = {}
    for module, path in files.items():
        edges = set()
        for name in named_imports(parse(path), module, path.endswith("__init__.py")):
            if name.endswith("*"):  # loaded by name: every module the constant start could resolve to
                edges |= {other for other in files if other.startswith(name[:-1])}
            elif name in files:
                edges.add(name)
        graph[module] = edges - {module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one module, each sorted (Tarjan's algorithm,
    with a stack of its own instead of recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:  # a new module: go down into it
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    work.append((child, iter(sorted(graph[child]))))
                    break
                if child in stack:  # back to a module of the component being built
                    low[node] = min(low[node], index[child])
            else:  # all its imports seen: back up
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:  # node is the root of a component: it is stack[node:]
                    component = stack[stack.index(node):]
                    del stack[stack.index(node):]
                    if len(component) > 1:
                        found.append(tuple(sorted(component)))
    return sorted(found)


# --- the command -------------------------------------------------------------------------------

def print_core(files: dict[str, str]) -> int:
    """Print each module's lines and the total; return the total."""
    lines = {name: line_count(path) for name, path in files.items()}
    for name, count in lines.items():
        print(f"{count:6d}  {name}")
    total = sum(lines.values())
    print(f"{total:6d}  lines in {len(lines)} modules (a plain dense-model generate on CPU)")
    return total


def print_cycles(graph: dict[str, set[str]], found: list[tuple[str, ...]]) -> None:
    print(f"{len(found)} import cycle(s) among the {len(graph)} modules of {PACKAGE}")
    for component in found:
        print(f"  {len(component)} modules:")
        for module in component:
            print(f"    {module} -> {', '.join(sorted(graph[module] & set(component)))}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-lines", type=int, default=None, help="exit 1 if the core's total is above this")
    parser.add_argument("--functions", type=int, nargs="?", const=40, default=None, metavar="N",
                        help="list the core's functions longer than N lines (40 if N is not given)")
    parser.add_argument("--max-function-lines", type=int, default=None, metavar="N",
                        help="exit 1 if a function of the core is longer than N lines")
    parser.add_argument("--cycles", action="store_true", help="list the package's import cycles")
    parser.add_argument("--no-cycles", action="store_true", help="exit 1 if the package has an import cycle")
    args = parser.parse_args(argv)
    failed = []
    core_asked = (args.max_lines, args.functions, args.max_function_lines) != (None, None, None)
    if core_asked or not (args.cycles or args.no_cycles):
        files = core_files()
        total = print_core(files)
        if args.max_lines is not None and total > args.max_lines:
            failed.append(f"over the budget of {args.max_lines} lines")
        limits = [n for n in (args.functions, args.max_function_lines) if n is not None]
        if limits:
            limit = min(limits)
            long = long_functions(files, limit)
            print(f"\n{len(long)} function(s) of the core over {limit} lines (def to last line, docstring included)")
            for name, length in long.items():
                print(f"{length:6d}  {name}")
            if args.max_function_lines is not None and max(long.values(), default=0) > args.max_function_lines:
                failed.append(f"a function of the core is over {args.max_function_lines} lines")
    if args.cycles or args.no_cycles:
        graph = import_graph(package_files())
        found = cycles(graph)
        print_cycles(graph, found)
        if args.no_cycles and found:
            failed.append(f"{len(found)} import cycle(s)")
    for reason in failed:
        print(reason, file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

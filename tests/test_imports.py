"""The package's import graph has no circle, counting function-local imports (the ones that
hid config <-> memory / distributed), and every module imports in a fresh interpreter."""

import ast
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules() -> dict[str, str]:
  """module name -> file, for every module of tlt_jax."""
  out = {}
  for dirpath, _, files in os.walk(os.path.join(ROOT, "tlt_jax")):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(dirpath, f)
        name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        out[name.removesuffix(".__init__")] = path
  return out


def _imports(name: str, path: str, modules: dict[str, str]) -> set[str]:
  """The tlt_jax modules `path` imports anywhere in its body (module level or in a function)."""
  package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
  deps = set()
  with open(path) as f:
    tree = ast.parse(f.read())
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      deps.update(a.name for a in node.names if a.name in modules)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parent = package
        for _ in range(node.level - 1):
          parent = parent.rpartition(".")[0]
        base = f"{parent}.{base}" if base else parent
      for a in node.names:
        if f"{base}.{a.name}" in modules:  # `from pkg import module`
          deps.add(f"{base}.{a.name}")
        elif base in modules:
          deps.add(base)
  return deps - {name}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in graph[v]:
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


def test_cycle_finder_finds_a_planted_circle():
  assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
  assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle():
  modules = _modules()
  graph = {name: _imports(name, path, modules) for name, path in modules.items()}
  assert graph["tlt_jax.config"] >= {"tlt_jax.errors", "tlt_jax.memory"}  # the parser works
  assert graph["tlt_jax.errors"] == set()  # the leaf
  assert _cycles(graph) == []


def test_every_module_imports_in_a_fresh_interpreter():
  names = sorted(_modules())
  code = "import importlib\nfor n in %r:\n  importlib.import_module(n)\n" % names
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]


def test_a_user_install_loads_the_tokenizer_without_torch_and_quietly():
  """A command-line process as tests start them (tests/user_env.py: torch hidden, as the main
  job's install has it) finds no torch, loads the shipped tokenizer through transformers, and
  prints nothing (transformers' "PyTorch was not found" advice is the project's to hide)."""
  from user_env import user_env
  code = ("import importlib.util\n"
          "assert importlib.util.find_spec('torch') is None\n"
          "from tlt_jax.config import asset_path\n"
          "from tlt_jax.models.tokenizer import load_tokenizer\n"
          "print(load_tokenizer(asset_path('default', 'model')).encode('12+3='))\n"
          "import transformers\n"
          "assert not transformers.utils.is_torch_available()\n")
  p = subprocess.run([sys.executable, "-c", code], cwd=ROOT,
                     env=user_env(JAX_PLATFORMS="cpu", PYTHONPATH=ROOT), capture_output=True,
                     text=True, timeout=300)
  assert p.returncode == 0, p.stderr[-2000:]
  # the ids the tokenizer file gives each character (the task's tokenizer is per character)
  import tokenizers
  tok = tokenizers.Tokenizer.from_file(os.path.join(ROOT, "tlt_jax", "assets", "default",
                                                    "model", "tokenizer.json"))
  want = [tok.token_to_id(c) for c in "12+3="]
  assert None not in want
  assert p.stdout.strip() == str(want) and p.stderr == "", (p.stdout, p.stderr)

"""The package tree is the architecture (each package's docstring): the rollout's policies
import no engine module, its draft sources import neither the engine nor the policies, the
learner (rl/) nothing of how responses were decoded, data/ only the tokenizer's loader, no
module the simulator (plan/), and
nothing imports a tlt_jax module or name that no longer exists. Read off the source with
`ast`, not by importing it."""

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PKG = os.path.join(ROOT, "tlt_jax")


def imports(path: str) -> set[str]:
  """Every module a file imports (absolute names; `from a import b` counts a and a.b), but
  those in an `except ImportError:` handler (a script's fallback for older checkouts)."""
  tree = ast.parse(open(path).read())
  fallback = {id(n) for h in ast.walk(tree) if isinstance(h, ast.ExceptHandler)
              and isinstance(h.type, ast.Name) and h.type.id == "ImportError"
              for n in ast.walk(h)}
  out = set()
  for node in ast.walk(tree):
    if id(node) in fallback:
      continue
    if isinstance(node, ast.Import):
      out |= {a.name for a in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      out.add(node.module)
      out |= {f"{node.module}.{a.name}" for a in node.names}
  return out


def defines(path: str) -> set[str]:
  """The names a module binds at its top level (functions, classes, assignments, imports)."""
  out = set()
  for node in ast.parse(open(path).read()).body:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      out.add(node.name)
    elif isinstance(node, (ast.Assign, ast.AnnAssign)):
      targets = node.targets if isinstance(node, ast.Assign) else [node.target]
      out |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
      out |= {(a.asname or a.name).split(".")[0] for a in node.names}
  return out


def modules(sub: str) -> list[str]:
  d = os.path.join(PKG, *sub.split("/"))
  return [os.path.join(d, f) for f in sorted(os.listdir(d)) if f.endswith(".py")]


def test_policies_import_no_engine_module():
  for path in modules("rollout/policies"):
    bad = {m for m in imports(path)
           if m.startswith("tlt_jax.rollout.") and not m.startswith("tlt_jax.rollout.policies")}
    assert not bad, f"{os.path.relpath(path, ROOT)} imports {sorted(bad)}"


def test_draft_sources_import_neither_engine_nor_policies():
  for path in modules("rollout/sources"):
    bad = {m for m in imports(path)
           if m.startswith("tlt_jax.rollout.") and not m.startswith("tlt_jax.rollout.sources")}
    assert not bad, f"{os.path.relpath(path, ROOT)} imports {sorted(bad)}"


def _package_imports(sub: str) -> dict[str, set[str]]:
  """Each module of tlt_jax/<sub> (its subpackages too) -> the tlt_jax modules it imports
  from outside <sub>."""
  own = "tlt_jax." + sub.replace("/", ".")
  out = {}
  for d, _, files in os.walk(os.path.join(PKG, sub)):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(d, f)
        out[os.path.relpath(path, ROOT)] = {
            m for m in imports(path) if m.startswith("tlt_jax.") and not m.startswith(own)}
  return out


def test_the_learner_imports_nothing_of_how_responses_were_decoded():
  """rl/ (GRPO, rewards) imports no rollout, drafter, coordinator or simulator module."""
  banned = ("tlt_jax.rollout", "tlt_jax.drafter", "tlt_jax.coordinator", "tlt_jax.plan",
            "tlt_jax.kernels")
  for path, mods in _package_imports("rl").items():
    bad = {m for m in mods if m.startswith(banned)}
    assert not bad, f"{path} imports {sorted(bad)}"


def test_data_imports_only_the_tokenizer_loader():
  for path, mods in _package_imports("data").items():
    bad = {m for m in mods if not m.startswith("tlt_jax.models.tokenizer")}
    assert not bad, f"{path} imports {sorted(bad)}"


@pytest.mark.parametrize("sub,allowed", [
    ("models", ("tlt_jax.kernels", "tlt_jax.sharding", "tlt_jax.watchdog")), ("kernels", ()),
    ("checkpoint", ())])
def test_the_bottom_layers_import_only_below_them(sub, allowed):
  for path, mods in _package_imports(sub).items():
    bad = {m for m in mods if m != "tlt_jax" and not m.startswith(allowed)}
    assert not bad, f"{path} imports {sorted(bad)}"


def test_the_watchdog_is_the_bottom():
  """Every loop that makes progress marks it (the engines', the learner's, the export's), so
  the watchdog imports no tlt_jax module."""
  bad = {m for m in imports(os.path.join(PKG, "watchdog.py")) if m.startswith("tlt_jax")}
  assert not bad, sorted(bad)


def test_the_simulator_is_a_leaf():
  """No module outside plan/ imports it (scripts and tests may)."""
  for d, _, files in os.walk(PKG):
    if os.path.relpath(d, PKG).split(os.sep)[0] == "plan":
      continue
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(d, f)
        bad = {m for m in imports(path) if m == "tlt_jax.plan" or m.startswith("tlt_jax.plan.")}
        assert not bad, f"{os.path.relpath(path, ROOT)} imports {sorted(bad)}"


def test_every_tlt_jax_import_names_a_module_or_a_name_in_one():
  """No import of a moved or deleted module is left anywhere in the package, scripts or
  tests (a name imported from a module must exist there: checked by importing each module
  once the file's imports are known to resolve)."""
  import importlib.util
  roots = [PKG, os.path.join(ROOT, "scripts"), os.path.join(ROOT, "tests")]
  missing = set()
  for root in roots:
    for d, _, files in os.walk(root):
      for f in files:
        if not f.endswith(".py"):
          continue
        for m in imports(os.path.join(d, f)):
          if not m.startswith("tlt_jax."):
            continue
          parent, _, leaf = m.rpartition(".")
          if importlib.util.find_spec(m.split(".")[0]) is None:
            continue
          try:
            if importlib.util.find_spec(m) is not None:
              continue
          except ModuleNotFoundError:
            pass
          spec = importlib.util.find_spec(parent) if parent else None
          if spec is None or spec.origin is None:
            missing.add((os.path.relpath(os.path.join(d, f), ROOT), m))
            continue
          if leaf not in defines(spec.origin):
            missing.add((os.path.relpath(os.path.join(d, f), ROOT), m))
  assert not missing, sorted(missing)


def _top_level_imports(path: str) -> set[str]:
  """The tlt_jax modules a file imports when it is imported (module level, not inside a
  function; `from pkg import name` counts pkg.name where that is a module)."""
  import importlib.util
  out = set()
  for node in ast.parse(open(path).read()).body:
    names = []
    if isinstance(node, ast.Import):
      names = [a.name for a in node.names]
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names = [node.module]
      for a in node.names:
        sub = f"{node.module}.{a.name}"
        if sub.startswith("tlt_jax.") and importlib.util.find_spec(node.module) is not None:
          try:
            if importlib.util.find_spec(sub) is not None:
              names.append(sub)
          except ModuleNotFoundError:
            pass
    out |= {n for n in names if n.startswith("tlt_jax.")}
  return out


def test_no_import_circle():
  """The package's module-level imports form no cycle (a package counts as its __init__)."""
  graph = {}
  for d, _, files in os.walk(PKG):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(d, f)
        rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
        name = rel[:-len(".__init__")] if rel.endswith(".__init__") else rel
        graph[name] = _top_level_imports(path)
  state: dict[str, int] = {}  # 1: on the path, 2: done

  def visit(m, path):
    state[m] = 1
    for n in sorted(graph.get(m, ())):
      if n not in graph or n == m:
        continue
      if state.get(n) == 1:
        raise AssertionError("import circle: " + " -> ".join(path[path.index(n):] + [n]))
      if n not in state:
        visit(n, path + [n])
    state[m] = 2

  for m in sorted(graph):
    if m not in state:
      visit(m, [m])

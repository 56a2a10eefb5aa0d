"""What SGLang would refuse of a ``--radix-cache-backend`` name, found without SGLang: for ``kvcore backends``.

kvcore-sglang answers kvcore's ``kvcore_engine_targets`` hook here (its entry point in
kvcore's plugin group), so ``kvcore backends`` lists every name SGLang would take, its own
and those other distributions declare (:data:`kvcore_sglang.plugin.TARGET_GROUP`), each
checked as the factory checks it when SGLang builds the cache: the declaration loads and
names a :class:`~kvcore_sglang.config.Target` of its entry point's name, the builder
module and function are there (read, not imported), the kvcore backend is installed, and
a target built the way ``kvcore-radix`` is (no builder of its own) serves full-attention
models only.  Nothing here imports SGLang or torch.
"""

from __future__ import annotations

import ast
import importlib.util
from importlib.metadata import EntryPoint

from kvcore import hookimpl
from kvcore.engine_targets import EngineTarget
from kvcore.errors import BackendNotFound
from kvcore.plugins import get_backend
from kvcore_sglang.config import TARGETS, Target
from kvcore_sglang.plugin import declared_targets, load_declared_target

__all__ = ["builder_problem", "kvcore_engine_targets", "target_problem"]


def _defines(path: str, name: str) -> bool:
    """Whether the Python source at ``path`` binds ``name`` at module level (a def, a class, an assignment, an
    import), read without running it."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            if any((a.asname or a.name.split(".")[0]) == name for a in node.names):
                return True
    return False


def builder_problem(builder: str) -> str | None:
    """Why ``builder`` ('module:function') would not build, or None; the module is found, not imported."""
    module, sep, function = builder.partition(":")
    if not sep or not module or not function.isidentifier():
        return f"builder {builder!r} must be 'module:function'"
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        return f"builder {builder!r}: module {module!r} cannot be found ({type(exc).__name__}: {exc})"
    if spec is None:
        return f"builder {builder!r}: no module {module!r} is installed"
    origin = spec.origin
    if origin and origin.endswith(".py") and not _defines(origin, function):
        return f"builder {builder!r}: module {module!r} ({origin}) defines no {function!r}"
    return None


def target_problem(target: Target, *, own: bool) -> str | None:
    """Why SGLang's build of ``target`` would be refused before it starts, or None."""
    problems = []
    try:
        get_backend(target.backend)
    except BackendNotFound as exc:
        problems.append(f"kvcore backend {target.backend!r} is not installed ({exc})")
    if target.builder is not None:
        why = builder_problem(target.builder)
        if why:
            problems.append(why)
    elif not own and set(target.serves) - {"full"}:
        hybrid = ", ".join(k for k in target.serves if k != "full")
        problems.append(f"serves {hybrid}, but without a builder of its own it is built as kvcore-radix is, which "
                        "serves full-attention models only: give it a builder, or serve ('full',)")
    return "; ".join(problems) or None


def _declared(name: str, ep: EntryPoint) -> EngineTarget:
    dist = ep.dist.name if ep.dist is not None else "?"
    try:
        target = load_declared_target(name, ep)
    except RuntimeError as exc:
        return EngineTarget(name, "sglang", "?", dist, problem=str(exc))
    return EngineTarget(name, "sglang", target.backend, dist, target.serves, target.description,
                        target_problem(target, own=False))


@hookimpl
def kvcore_engine_targets() -> list[EngineTarget]:
    """SGLang's ``--radix-cache-backend`` names for kvcore backends, kvcore-sglang's own and declared ones."""
    out = [EngineTarget(t.name, "sglang", t.backend, "kvcore-sglang", t.serves, t.description,
                        target_problem(t, own=True)) for t in TARGETS]
    out += [_declared(name, ep) for name, ep in declared_targets()]
    return out

"""The backends satisfy hybrid.backends.base's Protocols, and the code that drives them calls nothing outside them."""

from __future__ import annotations

import ast
import inspect
import sys
import textwrap
import typing
from pathlib import Path

import pytest

from hybrid.backends.base import OPTIONAL_PROTOCOLS, Backend, DeviceMemory, GraphDecoding
from hybrid.backends.cpu import CpuBackend
from hybrid.backends.gpu import GpuBackend  # importing needs no CuPy; constructing one does
from hybrid.backends.offload import OffloadBackend

ROOT = Path(__file__).resolve().parents[1]
BACKENDS = (CpuBackend, GpuBackend, OffloadBackend)
# which backend classes claim which optional capability
OPTIONAL = {GraphDecoding: (GpuBackend,), DeviceMemory: (GpuBackend,)}

# the code that drives backends, and the names a backend goes by there
CALLER_GLOBS = ("hybrid/model/arch/*.py", "hybrid/model/forward.py", "hybrid/engine/*.py", "hybrid/kv/cache.py",
                "hybrid/backends/op_offload.py")
RECEIVER_NAMES = {"be", "backend", "gpu", "cpu", "prev", "src", "dst"}  # engine: prev (_run_layers), src/dst (_move)
RECEIVER_SELF_ATTRS = {"_cpu", "gpu", "cpu", "backend", "output_backend"}  # self.cpu (engine), self.gpu (op offload)


def protocol_members(proto: type) -> set[str]:
    if sys.version_info >= (3, 13):
        return set(typing.get_protocol_members(proto))
    names: set[str] = set()
    for klass in proto.__mro__:
        if klass in (typing.Protocol, typing.Generic, object):
            continue
        names |= set(klass.__dict__.get("__annotations__", {}))
        names |= {n for n in klass.__dict__ if not n.startswith("_")}
    return names


def _static(owner: type, name: str):
    return inspect.getattr_static(owner, name)


def _is_method(obj) -> bool:
    return inspect.isfunction(obj) or isinstance(obj, (staticmethod, classmethod))


def _params(owner: type, name: str) -> list[inspect.Parameter]:
    """The parameters of owner.name without self (none to drop for a staticmethod)."""
    obj = _static(owner, name)
    fn = obj.__func__ if isinstance(obj, (staticmethod, classmethod)) else obj
    params = list(inspect.signature(fn).parameters.values())
    return params if isinstance(obj, staticmethod) else params[1:]


def _init_assigns(cls: type) -> set[str]:
    """Names the class's __init__ assigns as self.<name> = ... (instance attributes, invisible on the class)."""
    init = cls.__dict__.get("__init__")
    if init is None:
        return set()
    tree = ast.parse(textwrap.dedent(inspect.getsource(init)))
    out = set()
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AnnAssign, ast.AugAssign)) else []
        for t in targets:
            for e in ast.walk(t):
                if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name) and e.value.id == "self":
                    out.add(e.attr)
    return out


def _cases():
    for cls in BACKENDS:
        yield pytest.param(Backend, cls, id=f"Backend-{cls.__name__}")
    for proto, classes in OPTIONAL.items():
        for cls in classes:
            yield pytest.param(proto, cls, id=f"{proto.__name__}-{cls.__name__}")


@pytest.mark.parametrize("proto, cls", list(_cases()))
def test_members_exist_on_class(proto, cls):
    """(a) Every member of the Protocol is on the class (or, for a data member, set by its __init__)."""
    have = set(dir(cls)) | _init_assigns(cls)
    missing = sorted(protocol_members(proto) - have)
    assert not missing, f"{cls.__module__}.{cls.__name__} lacks {proto.__name__} members {missing}"


@pytest.mark.parametrize("proto, cls", list(_cases()))
def test_signatures_compatible(proto, cls):
    """(b) Each method takes the Protocol's parameters, same names, kinds and order; extra trailing ones have
    defaults. Properties stay properties."""
    problems = []
    for name in sorted(protocol_members(proto)):
        want = _static(proto, name) if name in proto.__dict__ else None
        if want is None:  # a data member (annotation only): checked for presence in (a)
            continue
        if not hasattr(cls, name) and name in _init_assigns(cls):
            continue
        got = _static(cls, name)
        where = f"{cls.__name__}.{name}"
        if isinstance(want, property):
            if not isinstance(got, property):
                problems.append(f"{where}: a property in {proto.__name__}, {type(got).__name__} here")
            continue
        if not _is_method(got):
            problems.append(f"{where}: a method in {proto.__name__}, {type(got).__name__} here")
            continue
        pw, pg = _params(proto, name), _params(cls, name)
        head = [(p.name, p.kind) for p in pg[: len(pw)]]
        if head != [(p.name, p.kind) for p in pw]:
            problems.append(f"{where}{inspect.signature(getattr(cls, name))}: expected "
                            f"{proto.__name__}.{name}{inspect.signature(_static(proto, name))}")
        extra = [p.name for p in pg[len(pw):]
                 if p.default is inspect.Parameter.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if extra:
            problems.append(f"{where}: extra parameters without defaults {extra}")
    assert not problems, "\n".join(problems)


def test_protocol_methods_documented():
    """Every Protocol method has a one-line-or-more docstring (shapes and dtypes)."""
    for proto in (Backend, *OPTIONAL_PROTOCOLS):
        for name in protocol_members(proto):
            obj = proto.__dict__.get(name)
            fn = obj.fget if isinstance(obj, property) else obj
            if fn is not None:
                assert (fn.__doc__ or "").strip(), f"{proto.__name__}.{name} has no docstring"


def test_cpu_instance_is_a_backend():
    """(c) A CpuBackend passes the runtime check; it has none of the GPU-only extras."""
    cpu = CpuBackend()
    assert isinstance(cpu, Backend)
    assert not isinstance(cpu, GraphDecoding)  # the engine runs CPU layers eagerly (no decode_step)
    assert not isinstance(cpu, DeviceMemory)


def test_optional_members_not_required():
    """The optional Protocols share nothing with Backend (a capability is either required or optional)."""
    required = protocol_members(Backend)
    for proto in OPTIONAL_PROTOCOLS:
        assert not required & protocol_members(proto), proto.__name__


def _receiver(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id in RECEIVER_NAMES
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
            and node.attr in RECEIVER_SELF_ATTRS)


def backend_uses() -> dict[str, list[str]]:
    """member name -> ["file:line", ...] for every attribute read, written or called on a backend in the callers,
    and every hasattr(x, "literal") there (the engine's capability tests)."""
    uses: dict[str, list[str]] = {}
    files = sorted({p for g in CALLER_GLOBS for p in ROOT.glob(g)})
    assert files, CALLER_GLOBS
    for path in files:
        rel = path.relative_to(ROOT)
        for node in ast.walk(ast.parse(path.read_text(), str(rel))):
            name = None
            if isinstance(node, ast.Attribute) and _receiver(node.value):
                name = node.attr
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "hasattr"
                  and len(node.args) == 2 and isinstance(node.args[1], ast.Constant)):
                name = node.args[1].value
            if name is not None:
                uses.setdefault(name, []).append(f"{rel}:{node.lineno}")
    return uses


def test_callers_use_only_protocol_members():
    """(d) The architecture code (arch/, forward.py), the engine, the KV cache and op offload touch no backend
    member outside the Protocols (Backend, or the listed optional ones)."""
    uses = backend_uses()
    allowed = protocol_members(Backend).union(*(protocol_members(p) for p in OPTIONAL_PROTOCOLS))
    outside = {k: v for k, v in uses.items() if k not in allowed}
    assert not outside, f"backend members used outside the Protocols: {outside}"
    # not vacuous: the blocks' ops, the KV cache's allocation and the engine's graph decoding were all seen
    assert {"fused_attention", "matmuls", "attention", "new_kv_layer", "decode_step", "name"} <= set(uses)


def test_every_required_member_is_used():
    """Backend holds nothing the callers do not need (GpuBackend/OffloadBackend-only helpers stay out of it)."""
    unused = sorted(protocol_members(Backend) - set(backend_uses()))
    assert not unused, f"Backend members no caller uses: {unused}"

"""The first run's kernel compile: the kernel table (kernels_cpu.signatures) and what a model needs of it, the
cache checks (the marker, Numba's index, where Numba keeps the cache), compiling in worker processes with its
progress, and, against a cold cache, that the kernels compiled ahead are exactly what the warm-up then loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numba
import numpy as np
import pytest

from kernels_cpu import drop_stale_cache, numba_cache_dir
from kernels_cpu.signatures import KERNELS, Kernel, closure

from hybrid.backends.cpu_kernels import cpu_kernel_keys
from hybrid.model.arch import arch_spec
from hybrid.model.weights import Weight
from hybrid.system.compile import (CompileStatus, compile_kernels, kernel_cache_stale, mark_kernels_compiled,
                                   uncached)

ROOT = Path(__file__).resolve().parents[1]

# -- the table --------------------------------------------------------------------------------------------------


def test_table_names_real_cached_kernels_and_its_calls():
    for key, k in KERNELS.items():
        fn = getattr(__import__(k.module, fromlist=[k.name]), k.name)
        assert isinstance(fn, numba.core.registry.CPUDispatcher), key
        assert fn._cache.__class__.__name__ == "FunctionCache", f"{key}: not cache=True"
        assert fn.py_func.__code__.co_argcount == len(k.args), key
        assert all(c in KERNELS for c in k.calls), key


def test_closure_puts_callees_first_once():
    order = [k.key for k in closure(["fused_layer.attention_half", "fused_layer.ffn_half"])]
    assert len(order) == len(set(order))
    pos = {key: i for i, key in enumerate(order)}
    for key in order:
        assert all(pos[c] < pos[key] for c in KERNELS[key].calls)
    assert order[-1] == "fused_layer.ffn_half" and "fused_layer.attention_half" in pos
    assert "vec_dot_k.dot2_q6_k" in pos and "legacy_x8._repack_groups" not in pos


# -- what a model needs -----------------------------------------------------------------------------------------
def _w(name: str, type_name: str, n_out: int, n_in: int) -> Weight:
    from gguf_io import quant_spec

    q = quant_spec(type_name)
    return Weight(name, type_name, (n_out, n_in), np.zeros((n_out, n_in // q.block_size * q.type_size), np.uint8))


def _layer(att: str, ffn: str, down: str | None = None) -> dict[str, Weight]:
    lw = {n: _w(n, att, 256, 256) for n in ("attn_q", "attn_k", "attn_v", "attn_output")}
    lw |= {n: _w(n, ffn, 512, 256) for n in ("ffn_gate", "ffn_up")}
    lw["ffn_down"] = _w("ffn_down", down or ffn, 256, 512)
    return lw


def test_a_q4_k_m_layer_takes_the_fused_kernels_and_its_repacks():
    keys = cpu_kernel_keys(arch_spec("llama"), [_layer("Q4_K", "Q4_K", "Q6_K")], _w("output", "Q8_0", 64, 256),
                           repack=True)
    assert keys == ("act_quant.quantize_q8_1_rows", "fused_layer.attention_half", "fused_layer.ffn_half",
                    "norm.rms_norm_rows", "q4_k_x8._repack_groups", "q8_0_x8._repack_groups",  # (the Q8_0 output)
                    "rope._rope_tables", "topk.top_k_ids", "vec_dot_legacy.matmul_q8_0_act")


def test_flags_and_types_change_the_list():
    spec, lw = arch_spec("llama"), [_layer("Q5_0", "Q4_K")]
    with_repack = cpu_kernel_keys(spec, lw, _w("output", "Q4_0", 64, 256), repack=True)
    assert {"legacy_x8._repack_groups", "q4_k_x8._repack_groups"} <= set(with_repack)
    assert not [k for k in cpu_kernel_keys(spec, lw, None, repack=False) if "repack" in k]  # -nr 1
    tied = cpu_kernel_keys(spec, [_layer("Q4_K", "Q4_K")], _w("token_embd", "Q4_0", 64, 256), repack=True,
                           output_tied=True)
    assert [k for k in tied if "repack" in k] == ["q4_k_x8._repack_groups"]  # not the lookup's Q4_0 rows
    tied = cpu_kernel_keys(spec, [_layer("Q4_K", "Q4_K")], _w("token_embd", "Q8_0", 64, 256), repack=True,
                           output_tied=True)
    assert {"q4_k_x8._repack_groups", "q8_0_x8._repack_groups"} <= set(tied)  # the lookup reads Q8_0_X8
    assert cpu_kernel_keys(spec, [], None, repack=True) == ("topk.top_k_ids",)  # every layer on the GPU: the sampler
    f16 = set(cpu_kernel_keys(spec, [_layer("F16", "F16")], None, repack=True))  # float matrices go op by op
    assert {"attention._attention_kernel", "kv_cache._store_kv", "rope.rope_apply_rows",
            "activations.glu_rows"} <= f16
    assert not [k for k in f16 if k.startswith("fused_layer") or "matmul_q8" in k]


# -- the cache --------------------------------------------------------------------------------------------------
def _tmp_package(tmp_path: Path, monkeypatch, name: str) -> Path:
    pkg = tmp_path / "pkgs" / name
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "k.py").write_text(textwrap.dedent("""
        from numba import njit

        @njit(cache=True)
        def twice(x):
            return 2 * x

        @njit(cache=True)
        def twice_plus_one(x):
            return twice(x) + 1
    """))
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path / "pkgs"), os.environ.get("PYTHONPATH", "")]))
    return pkg


def test_compile_check_follows_marker_and_numba_cache(tmp_path, monkeypatch):
    pkg = _tmp_package(tmp_path, monkeypatch, "hybrid_tmp_kernels")
    marks = tmp_path / "marks"
    assert kernel_cache_stale(marks, "hybrid_tmp_kernels")  # nothing compiled, no marker
    mark_kernels_compiled(marks, "hybrid_tmp_kernels")
    assert kernel_cache_stale(marks, "hybrid_tmp_kernels")  # marker, but Numba's cache is empty (wiped)
    from hybrid_tmp_kernels.k import twice

    assert twice(2) == 4  # compiles and writes k.twice-*.nbi
    assert not kernel_cache_stale(marks, "hybrid_tmp_kernels")
    (pkg / "k.py").write_text((pkg / "k.py").read_text() + "\n# changed\n")
    assert kernel_cache_stale(marks, "hybrid_tmp_kernels")  # sources changed: compiles again


def test_stale_cache_is_dropped_where_numba_keeps_it(tmp_path, monkeypatch):
    pkg = _tmp_package(tmp_path, monkeypatch, "hybrid_tmp_kernels_dir")
    assert numba_cache_dir(pkg) == pkg / "__pycache__"  # in the tree, where it is writable
    monkeypatch.setattr(numba.config, "CACHE_DIR", str(tmp_path / "numba"))  # $NUMBA_CACHE_DIR
    cache = numba_cache_dir(pkg)
    assert cache.parent == tmp_path / "numba" and cache.name.startswith("hybrid_tmp_kernels_dir_")
    assert drop_stale_cache(pkg)  # no stamp yet
    (cache / "k.twice-5.py311.nbi").write_bytes(b"old")
    assert not drop_stale_cache(pkg) and (cache / "k.twice-5.py311.nbi").exists()  # same sources: kept
    (pkg / "k.py").write_text((pkg / "k.py").read_text() + "\n# changed\n")
    assert drop_stale_cache(pkg) and not (cache / "k.twice-5.py311.nbi").exists()  # changed: dropped


@pytest.mark.parametrize("n_workers", [1, 2])
def test_kernels_compile_ahead_then_load_without_compiling(tmp_path, monkeypatch, n_workers):
    name = f"hybrid_tmp_ahead{n_workers}"
    _tmp_package(tmp_path, monkeypatch, name)
    ks = [Kernel(f"{name}.k", "twice", (numba.int64,)),
          Kernel(f"{name}.k", "twice_plus_one", (numba.int64,), ("k.twice",))]
    assert uncached(ks) == ks
    seen: list[CompileStatus] = []
    assert compile_kernels(ks, n_workers, seen.append) == []
    assert seen[0].done == 0 and seen[-1].done == seen[-1].total == 2 and not seen[-1].running
    assert seen[0].running[0] == "k.twice"  # the callee first
    assert [s.done for s in seen] == sorted(s.done for s in seen)
    assert uncached(ks) == []
    code = (f"from {name}.k import twice_plus_one as f; assert f(3) == 7; "
            "print(sum(f.stats.cache_hits.values()), sum(f.stats.cache_misses.values()))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["1", "0"]  # loaded, not compiled


def test_a_failing_kernel_is_reported_and_the_rest_compiles(tmp_path, monkeypatch):
    _tmp_package(tmp_path, monkeypatch, "hybrid_tmp_fail")
    ks = [Kernel("hybrid_tmp_fail.k", "twice", (numba.types.unicode_type, numba.int64)),  # wrong arity
          Kernel("hybrid_tmp_fail.k", "twice_plus_one", (numba.float64,))]
    failed = compile_kernels(ks, 2)
    assert [f[0] for f in failed] == ["k.twice"] and uncached(ks[1:]) == []


# -- against a cold cache ---------------------------------------------------------------------------------------
_COLD = """
import json, sys
from pathlib import Path
from numba.core import event
from kernels_cpu.signatures import closure
from hybrid.backends.cpu import CpuBackend
from hybrid.engine.engine import Engine
from hybrid.engine.params import EngineParams
from hybrid.system.compile import compile_kernels, uncached

out = {"compiled": [], "failed": [], "late": []}

class Late(event.Listener):  # every compile during the warm-ups (the kernels listed should all load instead)
    def on_start(self, ev):
        d = ev.data["dispatcher"].py_func
        out["late"].append(f"{d.__module__}.{d.__name__}")
    def on_end(self, ev):
        pass

def ahead(engine):
    if sys.argv[2] == "unfused":
        engine.backends = [CpuBackend(fused=False)] * len(engine.backends)
        engine.output_backend = engine.backends[0]
    todo = closure(engine.cpu_kernels())
    out["compiled"] += [k.key for k in uncached(todo)]
    out["failed"] += compile_kernels(uncached(todo), 2)
    out["uncached_after"] = [k.key for k in uncached(todo)]

engine = Engine.load(Path(sys.argv[1]), EngineParams(n_ctx=64), on_placed=ahead)
listener = Late()
event.register("numba:compile", listener)
engine.warmup()
event.unregister("numba:compile", listener)
print(json.dumps(out))
"""


@pytest.mark.slow
def test_kernels_compiled_ahead_are_all_the_warmup_needs(demo_model, tmp_path):
    """From an empty Numba cache ($NUMBA_CACHE_DIR): the fused engine's list compiles in two worker processes
    without a failure, then its warm-up compiles nothing from kernels_cpu (every kernel loads); an unfused engine
    then needs only its own few additions, and they load too."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    for mode in ("fused", "unfused"):
        r = subprocess.run([sys.executable, "-c", _COLD, str(demo_model), mode], env=env, capture_output=True,
                           text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["failed"] == [] and out["uncached_after"] == [], out
        assert [m for m in out["late"] if m.startswith("kernels_cpu.")] == [], out["late"]
        if mode == "fused":
            assert "fused_layer.attention_half" in out["compiled"]
        else:
            assert out["compiled"] == [], out["compiled"]  # the same kernels, called op by op

#!/usr/bin/env python3
"""Write a synthetic GGUF model (random quantized weights with sane scales) of any supported architecture and size.

    python3 scripts/make_model.py OUT.gguf --arch llama --preset llama-8b [--seed 1] [--vocab PATH] [--type Q4_K_M]
    python3 scripts/make_model.py OUT.gguf --arch qwen3moe --preset tiny --n-layer 4 --dry-run
    python3 scripts/make_model.py OUT.gguf --arch gpt-oss --preset gpt-oss-20b --type MXFP4_MOE --dry-run
    python3 scripts/make_model.py OUT.gguf --arch glm4moe --preset glm-4.5-air --type IQ4_XS --dry-run

Needs numpy only (no `gguf` package). See hybrid/tools/synth/.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hybrid.tools.synth.model import PRESETS, plan_model, write_plan  # noqa: E402
from hybrid.tools.synth.qtypes import MIXES  # noqa: E402
from gguf_io.config import SUPPORTED_ARCHITECTURES  # noqa: E402

_OVERRIDES = ("n_layer", "n_embd", "n_head", "n_head_kv", "n_ff", "n_vocab", "head_dim", "n_expert",
              "n_expert_used", "n_ff_exp", "n_ctx_train", "n_swa", "n_expert_shared", "n_layer_dense_lead", "n_rot")


def _args(argv):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", type=Path, help="the GGUF file to write")
    ap.add_argument("--arch", default="llama", choices=SUPPORTED_ARCHITECTURES)
    ap.add_argument("--preset", default="tiny", choices=list(PRESETS))
    ap.add_argument("--type", dest="qtype_mix", default="Q4_K_M", type=str.upper, choices=MIXES,
                    help="Q4_K_M (llama.cpp's mix) or one type for every matrix")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=Path, help="copy the tokenizer.* metadata of this GGUF (e.g. a ggml-vocab-*.gguf)")
    ap.add_argument("--name", help="general.name (default synthetic-ARCH-PRESET)")
    ap.add_argument("--threads", type=int, help="generator threads (default: up to 8 cores)")
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the size, write nothing")
    for f in _OVERRIDES:
        ap.add_argument("--" + f.replace("_", "-"), type=int, dest=f)
    ap.add_argument("--rope-freq-base", type=float)
    ap.add_argument("--router-skew", type=float, help="MoE archs: a skewed router, the experts' share of tokens "
                    "Zipf-like with this exponent, different per layer (e.g. 1.0; default 0: even)")
    ap.add_argument("--tied", action=argparse.BooleanOptionalAction, default=None,
                    help="no output.weight: the LM head is token_embd (default: the preset's / gemma3)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    a = _args(argv)
    overrides = {f: getattr(a, f) for f in _OVERRIDES + ("rope_freq_base", "tied", "router_skew")}
    plan = plan_model(a.arch, a.preset, a.qtype_mix, a.vocab, a.name, **overrides)
    size = plan.layout.file_size
    types = Counter(t.type_name for t in plan.tensors)
    print(f"{a.out}: {a.arch} {a.preset} {a.qtype_mix}, {len(plan.tensors)} tensors "
          f"({', '.join(f'{k} {v}' for k, v in types.most_common())}), {size:,} bytes = {size / 2**30:.3f} GiB")
    print(f"shape: {plan.shape}")
    if a.dry_run:
        return 0

    t0, done, n = time.perf_counter(), [0], len(plan.tensors)

    def progress(i, t):  # one line per tensor group: a layer, or the tensors outside the layers
        done[0] += t.nbytes
        m = re.match(r"blk\.(\d+)\.", t.name)
        nxt = plan.tensors[i + 1].name if i + 1 < n else ""
        if m is None or not nxt.startswith(f"blk.{m.group(1)}."):
            what = f"layer {int(m.group(1)) + 1}/{plan.shape.n_layer}" if m else t.name
            dt = time.perf_counter() - t0
            print(f"  {what:<28} {done[0] / 2**30:7.2f} GiB  {dt:6.1f} s  {done[0] / 2**20 / max(dt, 1e-9):6.0f} MiB/s",
                  flush=True)

    write_plan(a.out, plan, a.seed, a.threads, progress)
    dt = time.perf_counter() - t0
    print(f"wrote {a.out} ({size / 2**30:.3f} GiB) in {dt:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

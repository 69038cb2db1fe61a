"""The instruction mix of a kernel's main loop, read from its SASS on a CPU host (no GPU): compile a
prefill variant with ``nvdisasm`` installed (the dev extra), find its loops (a backward branch to a
label), and count the largest loop's instructions by opcode, with the ones inside the blocks a warp
branches over (``@!P BRA`` forward to a label inside the loop: e.g. the lean softmax's skippable
rescale). docs/design/sm80.md#the-lean-softmax-opt-in.

Usage: ``python -m profiling.sass_loops [--kernel sm80|sm90] [--head-dim 128] [--target sm_90a]
[--tuning lean_softmax=true,...]`` (a 16-bit cache, GQA 4, page 16, causal, no LSE).
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from dataclasses import dataclass

_INSTR = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_BRANCH = re.compile(r"BRA\s+`\((\.L_x_\d+)\)")


@dataclass
class Loop:
    start: int
    end: int
    ops: Counter  # opcode (its first word, without modifiers) -> count
    skippable: int  # instructions inside forward branches that stay within the loop

    @property
    def size(self) -> int:
        return sum(self.ops.values())


def parse(sass: str) -> tuple[list[tuple[int, str]], dict[str, int]]:
    """``[(address, instruction text)]`` and ``{label: address of its first instruction}``."""
    instrs: list[tuple[int, str]] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    for line in sass.splitlines():
        lm = _LABEL.match(line)
        if lm:
            pending.append(lm.group(1))
            continue
        m = _INSTR.match(line)
        if m:
            address = int(m.group(1), 16)
            instrs.append((address, m.group(2)))
            for name in pending:
                labels[name] = address
            pending = []
    return instrs, labels


def opcode(text: str) -> str:
    """``"@!P0 FMUL.FTZ R1, R2, R3"`` -> ``"FMUL"``."""
    words = text.split()
    word = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
    return word.split(".")[0]


def loops(sass: str) -> list[Loop]:
    """Every loop (a branch back to an earlier label), largest first."""
    instrs, labels = parse(sass)
    found = []
    for address, text in instrs:
        m = _BRANCH.search(text)
        if not (m and m.group(1) in labels and labels[m.group(1)] < address):
            continue
        start, end = labels[m.group(1)], address
        body = [(a, t) for a, t in instrs if start <= a <= end]
        skipped: set[int] = set()
        for a, t in body:
            f = _BRANCH.search(t)
            if t.startswith("@") and f and f.group(1) in labels and a < labels[f.group(1)] <= end:
                skipped.update(b for b, _ in body if a < b < labels[f.group(1)])
        found.append(Loop(start, end, Counter(opcode(t) for _, t in body), len(skipped)))
    return sorted(found, key=lambda lp: -lp.size)


def _config(kernel: str, head_dim: int, target: str, tuning: dict):
    problem = dict(q_dtype="bf16", kv_dtype="bf16", head_dim=head_dim, group=4, page_size=16, kv_form="single",
                   kv_layout="HND", causal=True, write_lse=False, k_scale_tensor=False, v_scale_tensor=False)
    if kernel == "sm80":
        from cute_kernels.plans import sm80

        return sm80.make_prefill_config(target=target, **problem, **tuning)
    from cute_kernels.plans import sm90_prefill

    return sm90_prefill.make_prefill_config(**problem, **tuning)


def main(argv=None) -> None:
    from cute_kernels.bench.harness import field_value, parse_fields
    from cute_kernels.jit.compiler import compile_config

    p = argparse.ArgumentParser(prog="python -m profiling.sass_loops")
    p.add_argument("--kernel", choices=("sm80", "sm90"), default="sm80")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--target", default="sm_90a")
    p.add_argument("--tuning", default="", help="config fields, K=V,... (e.g. lean_softmax=true)")
    a = p.parse_args(argv)
    config = _config(a.kernel, a.head_dim, a.target, parse_fields(a.tuning, ",", field_value))
    compiled = compile_config(config, a.target, artifacts=True)
    if not compiled.sass:
        raise SystemExit("no SASS: install nvdisasm (pip install -e '.[dev]')")
    print(config.label())
    for loop in loops(compiled.sass)[:2]:
        print(f"loop {loop.start:#x}-{loop.end:#x}: {loop.size} instructions, {loop.skippable} inside branches "
              f"a warp may skip")
        print("  " + ", ".join(f"{k} {v}" for k, v in loop.ops.most_common()))


if __name__ == "__main__":
    main()

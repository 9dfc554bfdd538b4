"""Checks that the student computes the teacher's function when configured to be the teacher.

A student whose prelude is teacher layers 0..k-1, whose one-block core is layer k run once
and whose coda is the remaining layers, with the loop features neutral (injection none +
state init prelude, or injection add + state init zeros; no loop norm), must give the
teacher's logits. Also: logits_by_depth equals forward at every depth. CPU, ~20 s (most of
it reading the GGUF).

  python3 tools/train/check_student.py --teacher T.gguf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from student import LoopedStudent, StudentConfig, init_from_teacher  # noqa: E402
from teacher import load_teacher  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def teacher_as_student(teacher, k: int, injection: str, state_init: str) -> LoopedStudent:
    n = len(teacher.layers)
    cfg = StudentConfig(n_pre=k, n_core=1, n_post=n - k - 1, max_depth=1, default_depth=1,
                        injection=injection, state_init=state_init, loop_norm=False,
                        core_init="stepwise", core_start=k)
    student = LoopedStudent(teacher.dims, cfg).eval()
    init_from_teacher(student, teacher)
    return student


@torch.no_grad()
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--teacher", required=True, help="teacher GGUF")
    ap.add_argument("--data", default=str(REPO / ".traindata" / "tokens"))
    ap.add_argument("--seq", type=int, default=48)
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    teacher, _ = load_teacher(args.teacher)
    val = Path(args.data) / "val.u16"
    if val.exists():
        ids = np.fromfile(val, dtype=np.uint16)[:args.seq].astype(np.int64)
    else:  # any tokens will do for an equality check
        ids = np.random.default_rng(0).integers(0, teacher.dims.vocab, args.seq)
    x = torch.from_numpy(ids)[None]
    want = teacher(x)
    failures = 0
    for k, injection, state_init in ((2, "none", "prelude"), (2, "add", "zeros"), (12, "add", "zeros")):
        got = teacher_as_student(teacher, k, injection, state_init)(x, 1)
        err = (got - want).abs().max().item()
        ok = err < 1e-3 * want.abs().max().item()
        failures += not ok
        print(f"teacher as student (prelude {k}, {injection}/{state_init}): max |logit diff| {err:.2e} "
              f"{'ok' if ok else 'FAIL'}")

    looped = LoopedStudent(teacher.dims, StudentConfig(max_depth=4, default_depth=4, core_init="stepwise",
                                                       core_start=10, loop_norm=True)).eval()
    init_from_teacher(looped, teacher)
    looped.loop_norm.weight.fill_(20.0)
    for d, logits in looped.logits_by_depth(x, [1, 2, 4]):
        err = (logits - looped(x, d)).abs().max().item()
        ok = err < 1e-4 * logits.abs().max().item()
        failures += not ok
        print(f"logits_by_depth == forward at depth {d}: max diff {err:.2e} {'ok' if ok else 'FAIL'}")
    print("all checks passed" if not failures else f"{failures} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

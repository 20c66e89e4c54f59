"""shardd's learning-rate schedules (worker/exec/lr_schedule.h) against
torch.optim.lr_scheduler on the same settings: LinearLR(1 / W, 1, W - 1)
for the warmup, then CosineAnnealingLR(T, lr_min) or LinearLR(1,
lr_min / lr, T) for the decay (each phase on its own optimizer, so no
SequentialLR quirk of a PyTorch version is measured), and the constant
schedule. Both sides compute in float64; PyTorch's cosine is recursive
(each step multiplies by a ratio of cosines), so a few ulp per step: the
bound 1e-12 relative over at most 200 steps leaves room, while a wrong
warmup, phase or end point is off by more than 1e-3.

    lr_schedule_test.py LR_SCHEDULE_DUMP
"""

import json
import subprocess
import sys

import torch


def torch_rates(kind, lr, warmup, decay, min_lr, steps):
    def run(scheduler_of, n, base):
        p = torch.nn.Parameter(torch.zeros(1, dtype=torch.float64))
        opt = torch.optim.SGD([p], lr=base)
        sched = scheduler_of(opt)
        out = []
        for _ in range(n):
            out.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        return out

    rates = []
    if warmup > 0:
        rates += run(lambda o: torch.optim.lr_scheduler.LinearLR(
            o, start_factor=1.0 / warmup, end_factor=1.0,
            total_iters=max(warmup - 1, 1)), warmup, lr)
    rest = steps - warmup
    span = decay - warmup
    if kind == "constant":
        rates += [lr] * rest
    elif kind == "cosine":
        # Compared up to the end of the decay (PyTorch's cosine climbs back
        # after T; shardd holds lr_min, checked below).
        rates += run(lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(
            o, T_max=span, eta_min=min_lr), min(rest, span + 1), lr)
    else:
        rates += run(lambda o: torch.optim.lr_scheduler.LinearLR(
            o, start_factor=1.0, end_factor=min_lr / lr, total_iters=span),
            rest, lr)
    return rates


def main():
    dump = sys.argv[1]
    cases = [
        ("constant", 0.01, 0, 0, 0.0, 30),
        ("constant", 0.01, 7, 0, 0.0, 30),
        ("cosine", 3e-3, 10, 110, 3e-4, 150),
        ("cosine", 1e-3, 0, 50, 0.0, 80),
        ("linear", 3e-3, 5, 45, 1e-4, 60),
        ("linear", 0.02, 1, 20, 0.0, 30),
    ]
    failures = 0
    for kind, lr, warmup, decay, min_lr, steps in cases:
        got = json.loads(subprocess.run(
            [dump, f"--kind={kind}", f"--lr={lr!r}", f"--warmup={warmup}",
             f"--decay={decay}", f"--min_lr={min_lr!r}", f"--steps={steps}"],
            check=True, capture_output=True, text=True, timeout=60).stdout)
        want = torch_rates(kind, lr, warmup, decay, min_lr, steps)
        worst = max(abs(g - w) / w if w else abs(g)
                    for g, w in zip(got, want))
        ok = worst <= 1e-12 and len(got) == steps
        # After the decay shardd holds lr_min.
        if kind != "constant":
            held = got[decay:]
            ok = ok and all(abs(x - min_lr) <= 1e-12 * lr for x in held)
        failures += not ok
        print(f"{'ok' if ok else 'FAIL'} {kind} lr {lr} warmup {warmup} "
              f"decay {decay} min {min_lr}: {len(want)} rates compared, "
              f"largest relative difference {worst:.1e}")
    if failures:
        print(f"FAIL: {failures} schedules differ")
        sys.exit(1)
    print("PASS")


if __name__ == "__main__":
    main()

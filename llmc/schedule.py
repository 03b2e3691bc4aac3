"""Learning-rate schedules, llm.c's four: cosine, linear, constant, wsd (warmup-stable-decay).

    lr = get_lr("cosine", step, max_lr=6e-4, warmup=700, max_steps=5000, final_frac=0.0)

`step` is 0-based. All four warm up linearly over `warmup` steps to max_lr ((step+1)/warmup).
After warm-up they go to final_frac * max_lr at the last step:
- cosine: half a cosine period;
- linear: a straight line;
- constant: stay at max_lr (final_frac ignored);
- wsd: stay at max_lr, then in the last 20% of the steps decay as 1 - sqrt(progress).
"""
from __future__ import annotations

import math

from llmc.errors import LLMCError

SCHEDULES = ("cosine", "linear", "constant", "wsd")
WSD_COOLDOWN_FRAC = 0.2


def get_lr(schedule: str, step: int, max_lr: float, warmup: int, max_steps: int, final_frac: float = 1.0) -> float:
    if schedule not in SCHEDULES:
        raise LLMCError(f"-k/--lr-schedule {schedule!r}: expected one of {', '.join(SCHEDULES)}")
    if step < warmup:
        return max_lr * (step + 1) / warmup
    if schedule == "constant":
        return max_lr
    min_lr = max_lr * final_frac
    span = max(max_steps - warmup, 1)
    if schedule == "wsd":
        cooldown = max(int(WSD_COOLDOWN_FRAC * max_steps), 1)
        start = max_steps - cooldown
        if step < start:
            return max_lr
        progress = min((step - start) / cooldown, 1.0)
        return min_lr + (1.0 - math.sqrt(progress)) * (max_lr - min_lr)
    progress = min((step - warmup) / span, 1.0)
    if schedule == "linear":
        return max_lr - progress * (max_lr - min_lr)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (max_lr - min_lr)

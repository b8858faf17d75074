"""The soak's faults: what, where and when, drawn from a seed so that a failing round can be replayed.

External faults are done to one arm's job from outside, as a cluster or an operator does them, once the arm has
logged their step and a drawn delay after it (mid-step, mid-save or mid-validation): a rank SIGKILLed, SIGTERM to
every process of the job, `scontrol requeue`, the time-limit warning. Injected faults are the trainer's test seams
(components/checkpoint/testing.py), set in the environment that `launch/pair.sh` passes to both arms: a crash and a
hang (in a collective, the loader, a save or a validation) at the same step of each arm.

The standard library only.
"""

from __future__ import annotations

import dataclasses
import random

ARMS = ("control", "mhar")
EXTERNAL = ("kill", "term", "requeue", "warning")
INJECTED = ("crash", "hang")
HANG_SITES = ("collective", "loader", "save", "validation")
AT_SAVES = ("save", "validation")  # sites at a checkpoint step (validation comes at the same steps)
# How each fault ends the job it hits (components/endings.py's classes).
ENDS_AS = {"kill": "crashed", "crash": "crashed", "hang": "hung", "term": "preempted", "requeue": "preempted"}
ENDS_AS["warning"] = "preempted"
RESTARTED = ("kill", "crash", "hang")  # what counts against [job] max_restarts
CLEAR = 3  # no injected fault within this many steps after an external one's step: each fault ends its own job run
FIRST = 2  # the first step a fault may come at: after step 1 has set the step time the watchdog sizes itself by
LAST_CLEAR = 3  # nor within this many steps of the end


@dataclasses.dataclass(frozen=True)
class Fault:
    kind: str  # EXTERNAL or INJECTED
    step: int  # external: done once the arm has logged this step; injected: at this step
    arm: str | None = None  # the arm an external fault hits (injected ones hit both)
    delay: float = 0.0  # external: after the step's line, in step times (the arm's median)
    rank: int = 0  # kill: the rank
    site: str = ""  # hang: where

    def __str__(self) -> str:
        where = {"kill": f"SIGKILL rank {self.rank}", "term": "SIGTERM to the job", "requeue": "scontrol requeue"}
        where |= {"warning": "the time-limit warning (USR1)", "crash": "crash (rank 1)", "hang": f"hang ({self.site})"}
        when = f"after step {self.step} + {self.delay:.2f} step" if self.kind in EXTERNAL else f"at step {self.step}"
        return f"{self.arm or 'both arms'}: {where[self.kind]} {when}"

    def env_entry(self) -> str:
        """The seam's entry (`<step>:once`, `<step>:<site>:once`)."""
        return f"{self.step}:once" if self.kind == "crash" else f"{self.step}:{self.site}:once"


def draw(seed: int, steps: int, save_every: int, external_per_arm: int) -> list[Fault]:
    """One round's faults: a crash and a hang in both arms, and `external_per_arm` external faults in each arm, their
    kinds dealt so that every kind comes once before any comes twice; all at distinct steps, none within CLEAR steps
    before an injected one (a fault never meets another in one job run), a hang in a save or a validation at a
    checkpoint step."""
    rng = random.Random(seed)
    kinds = []
    while len(kinds) < external_per_arm * len(ARMS):
        kinds += rng.sample(EXTERNAL, len(EXTERNAL))
    last = steps - LAST_CLEAR
    for _ in range(10_000):
        site = rng.choice(HANG_SITES)
        hang = rng.choice([s for s in range(FIRST, last + 1) if site not in AT_SAVES or s % save_every == 0] or [0])
        crash = rng.randint(FIRST, last)
        injected = {hang, crash}
        if hang == 0 or crash == hang:
            continue
        faults = [Fault("crash", crash), Fault("hang", hang, site=site)]
        for i, arm in enumerate(ARMS):
            free = [s for s in range(FIRST, last + 1) if not injected & set(range(s, s + CLEAR + 1))]
            if len(free) < external_per_arm:
                break
            for j, step in enumerate(sorted(rng.sample(free, external_per_arm))):
                kind = kinds[i * external_per_arm + j]
                rank = rng.randrange(2) if kind == "kill" else 0
                faults.append(Fault(kind, step, arm, delay=rng.randrange(100) / 100, rank=rank))
        else:
            return sorted(faults, key=lambda f: (f.step, f.arm or ""))
    raise ValueError(
        f"{steps} steps cannot hold a crash, a hang and {external_per_arm} external faults an arm {CLEAR} steps clear "
        f"of them: ask for more steps or fewer faults"
    )

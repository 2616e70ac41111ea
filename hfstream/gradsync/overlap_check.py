"""Saying so when overlap is lost: a step whose reductions could not run while backward did.

Nothing breaks when overlap is lost -- the gradients are right -- so without a word a run is
silently slow. Two patterns are recognised, each only when it holds for `SUSPECT_STEPS`
synchronised steps in a row (one odd step of a tiny model is not a pattern):
- no bucket launched while backward ran: every reduction waited for ``finish()`` (the first
  bucket waits for a gradient that comes last, or never);
- every gradient arrived at once at the end of backward, within `NO_SPREAD` of the step
  (measured from the forward to ``finish()``, launch time excluded): what a compiled backward
  (``torch.compile``) delivers, since it returns all gradients together.
"""

from __future__ import annotations

import sys
import time

NO_SPREAD = 0.02    # gradients within this fraction of a step arrived "at once"
SUSPECT_STEPS = 3   # consecutive synchronised steps before overlap is reported lost


def anything_compiled() -> bool:
    """Whether torch.compile (Dynamo) compiled a frame in this process; False where it was never used."""
    dynamo = sys.modules.get("torch._dynamo")   # imported by transformers whether or not anything compiles
    if dynamo is None:
        return False
    try:
        return dynamo.utils.counters["frames"]["ok"] > 0   # private counters: a hint, not worth an error
    except Exception:
        return False


class OverlapCheck:
    """Fed host times during each synchronised step; `step_done` returns the note to say (once), else None.

    Args:
        mode: GradSync's mode, named in the note (a benchmark runs several side by side).
    """

    def __init__(self, mode: str = "overlap"):
        self.mode = mode
        self._suspect = 0
        self.said = False
        self.reset()

    def reset(self) -> None:
        self.forward_time = None                    # host time of this step's synchronised forward
        self.first_hook = self.last_hook = None     # host times of its first and last synchronised hook
        self.launching_s = 0.0                      # host time the hooks spent launching buckets

    def hook(self) -> bool:
        """A synchronised gradient hook fired now; True for the step's first."""
        self.last_hook = time.perf_counter()
        first = self.first_hook is None
        if first:
            self.first_hook = self.last_hook
        return first

    def step_done(self, step: int, buckets, launched_in_backward: int, t_enter: float) -> str | None:
        """``t_enter``: when ``finish()`` began. Judges the step just finished."""
        t_forward = self.forward_time
        spread = None if self.first_hook is None else self.last_hook - self.first_hook - self.launching_s
        if self.said or len(buckets) < 2:
            return None   # one bucket (bucket_mb=inf): nothing can launch before the last gradient, by choice
        why = None
        if launched_in_backward == 0:
            why = (f"no bucket was launched while backward ran: all {len(buckets)} waited for finish() "
                   f"(the first bucket, {', '.join(buckets[0].names[:4])}, never completed in backward)")
        elif t_forward is not None and spread is not None and spread < NO_SPREAD * (t_enter - t_forward):
            at_once = (f"every gradient arrived at once, at the end of backward ({max(spread, 0) * 1e3:.2f} ms "
                       f"apart in a {(t_enter - t_forward) * 1e3:.1f} ms step, launches excluded)")
            if anything_compiled():
                why = (f"{at_once}: the backward returns all gradients together, as a compiled model "
                       f"(torch.compile) does without graph breaks at bucket boundaries; grad_sync='native' gets "
                       f"DDP's graph splitting")
            else:
                # Eager autograd runs each parameter's hook as soon as its gradient is ready; gradients
                # bunch up when the compute between them is tiny next to the step (a small model, or
                # time spent outside the backward's kernels) or the time between them went to launching.
                why = (f"{at_once}; nothing is compiled, so the backward had almost no compute between the "
                       f"first and the last gradient to hide the reductions behind ({self.launching_s * 1e3:.2f} "
                       f"ms of it went to launching {len(buckets)} buckets): a model this small gains nothing "
                       f"from overlap, fewer buckets (a larger grad_bucket_mb) launch less")
        self._suspect = self._suspect + 1 if why else 0
        if self._suspect < SUSPECT_STEPS:
            return None
        self.said = True
        return (f"GradSync(mode={self.mode!r}): overlap lost in synchronised steps {step - SUSPECT_STEPS + 1}-{step}: "
                f"{why}.")

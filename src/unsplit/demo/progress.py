"""The demo's progress bar in estimated seconds, refined once the reference has been timed."""

from __future__ import annotations

from typing import Any

# Guesses of what each run costs, refined once the reference has been timed: a step
# costs `cost` reference steps, a run's compiles cost `compiles` reference compiles plus
# `fixed_s` seconds that do not scale with them.
_GUESS_STEP_S = 0.03
_GUESS_COMPILE_S = 5.0


class Progress:
    """Progress in estimated seconds; the estimate is refined once the reference is timed."""

    def __init__(self, steps: int, bar: Any = None):
        self.steps, self.bar, self.done, self.total = steps, bar, 0.0, 1.0
        self.step_s, self.compile_s = _GUESS_STEP_S, _GUESS_COMPILE_S
        self.task = None if bar is None else bar.add_task("training", total=1.0)

    def plan(self, remaining: list[tuple[float, float, float]]) -> float:
        """Sets the total from the runs left, as (step cost, compiles, fixed s); returns seconds left."""
        left = sum(c * self.compile_s + f + self.steps * s * self.step_s for s, c, f in remaining)
        self.total = self.done + left
        self._show()
        return left

    def label(self, text: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=text)

    def advance(self, seconds: float) -> None:
        self.done = min(self.done + seconds, self.total)
        self._show()

    def _show(self) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=self.done, total=self.total)


def duration(seconds: float) -> str:
    seconds = max(1, round(seconds))
    return f"{seconds} s" if seconds < 90 else f"{seconds // 60} min {seconds % 60:02d} s"

"""Paired, interleaved timing of two code paths in one process, and a verdict taken on its interval.

    sides = {"plain": plain_step, "wrapped": wrapped_step}      # each does one training step
    result = paired.measure(sides, rounds=60, steps=10)
    paired.verdict(result["cpu"]["interval"], target=1.03)      # "yes", "no" or "no verdict (noise +-X%)"

Each round runs one short block of `steps` steps of every side, in an order drawn at random (seeded) per round,
on the same data. A block is timed by wall clock and by the process's CPU time (user+sys of every thread);
the ratio of a side to "plain" is taken round by round, so a change of the machine's speed between rounds (this
2-core machine is shared) falls on both sides of a ratio. The estimate is the 20%-trimmed mean of the rounds'
log ratios, and its 95% interval a percentile bootstrap over rounds (scipy.stats.trim_mean and
scipy.stats.bootstrap).

Verdict on a target (wrapped <= target x plain): "yes" when the interval's upper end is under the target, "no"
when its lower end is over it, "no verdict (noise +-X%)" otherwise, X the interval's half-width.

Calibration (benchmarks/calibrate.py) uses `slowdown`: a test-only switch that adds a fixed busy-wait to every
step of the sides named, `slowdown[name]` times the plain step's CPU time measured after the warm-up, so a side
that does the same work as plain reads about 1 + slowdown. The busy-wait is an empty Python loop of a fixed
number of iterations, sized on the CPU clock before the rounds: CPU work of a known amount, as wrapper code
would be, not a sleep. On a loaded machine the loop and the step both run at other speeds than when the loop was
sized, so `measure` also times the loop alone after the rounds, against the rounds' own plain step
("spin_alone"); a slowed copy of plain reads its own ratio beside it (within a step the loop costs more than
alone, by cache and call effects: calibrate.md shows both).
"""
import math
import random
import statistics
import time

import numpy as np
from scipy import stats

TRIM = 0.2  # of the rounds' log ratios at each end: a block hit by another process's burst counts as an outlier
RESAMPLES = 2000
CLOCKS = ("cpu", "thread", "wall")


def spin(iterations: int) -> None:
    """A fixed amount of CPU work: an empty loop of `iterations` (no clock read inside, so nothing to overshoot)."""
    for _ in range(iterations):
        pass


def spins_per_second(seconds: float = 0.25) -> float:
    """How many spin iterations this process runs per CPU second (the median of 5 tries)."""
    rates = []
    for _ in range(5):
        iterations, start = 0, time.process_time()
        while time.process_time() - start < seconds / 5:
            spin(10_000)
            iterations += 10_000
        rates.append(iterations / (time.process_time() - start))
    return statistics.median(rates)


def spin_cost(iterations: int, steps: int, blocks: int = 5) -> float:
    """CPU seconds that spin(iterations) takes, median of `blocks` blocks of `steps` calls."""
    def block():
        start = time.process_time()
        for _ in range(steps):
            spin(iterations)
        return (time.process_time() - start) / steps
    return statistics.median(block() for _ in range(blocks))


def _block(step, steps: int) -> dict:
    """Seconds per step of one block, by each clock."""
    wall, cpu, thread = time.perf_counter(), time.process_time(), time.thread_time()
    for _ in range(steps):
        step()
    return {"wall": (time.perf_counter() - wall) / steps, "cpu": (time.process_time() - cpu) / steps,
            "thread": (time.thread_time() - thread) / steps}


def with_slowdown(sides: dict, slowdown: dict, steps: int, warmup: int = 2, estimate: int = 5,
                  clock: str = "cpu") -> tuple[dict, dict]:
    """Warm every side up (`warmup` blocks each); return the sides with each `slowdown[name]` busy-wait added
    to its step, and the spin iterations per step by side (sized on the median of `estimate` more plain blocks,
    by `clock`)."""
    for _ in range(warmup):
        for step in sides.values():
            _block(step, steps)
    plain = [_block(sides["plain"], steps)[clock] for _ in range(estimate if slowdown else 0)]
    waits = {name: fraction * statistics.median(plain) for name, fraction in (slowdown or {}).items() if fraction}
    rate = spins_per_second() if waits else 0.0
    spins = {name: round(wait * rate) for name, wait in waits.items()}

    def slowed(step, iterations):
        def run():
            step()
            spin(iterations)
        return run
    return {name: slowed(step, spins[name]) if name in spins else step for name, step in sides.items()}, spins


def measure(sides: dict, rounds: int, steps: int, seed: int = 0, slowdown: dict | None = None,
            warmup: int = 2, clock: str = "cpu") -> dict:
    """Time `sides` ({"plain": fn, other: fn, ...}) in `rounds` rounds of one block of `steps` steps each.
    Returns per side: seconds per step of every block ("wall", "cpu"), and for sides other than plain,
    per clock the ratio estimate and interval (`summarize`); plus the orders and the busy-waits, sized against
    the plain step by `clock` (the clock the verdict is taken on)."""
    sides, spins = with_slowdown(sides, slowdown, steps, warmup, clock=clock)
    samples = {name: {clock: [] for clock in CLOCKS} for name in sides}
    names = list(sides)
    order, shuffle, orders = list(range(len(names))), random.Random(seed).shuffle, []
    for _ in range(rounds):
        shuffle(order)
        orders.append("".join(map(str, order)))  # indices into the sides, in their order
        for name in (names[i] for i in order):
            for clock, seconds in _block(sides[name], steps).items():
                samples[name][clock].append(seconds)
    plain_cpu = statistics.median(samples["plain"][clock])
    waits = {name: spin_cost(iterations, steps) for name, iterations in spins.items()}  # measured, after the rounds
    return {"samples": samples, "sides": names, "orders": orders, "busy_wait_s": waits, "rounds": rounds,
            "steps": steps, "ratios": ratios(samples, seed), "spins": spins,
            "spin_alone": {name: wait / plain_cpu for name, wait in waits.items()}}


def ratios(samples: dict, seed: int = 0) -> dict:
    """Per side other than plain, per clock: `summarize` of its blocks against plain's."""
    return {name: {clock: summarize(values[clock], samples["plain"][clock], seed) for clock in CLOCKS}
            for name, values in samples.items() if name != "plain"}


def _trimmed_mean(values, axis=-1):
    return stats.trim_mean(values, TRIM, axis=axis)


def summarize(side: list[float], plain: list[float], seed: int = 0) -> dict:
    """The ratio side/plain, paired by round: estimate (exp of the trimmed mean of log ratios) and 95% interval
    (percentile bootstrap over rounds), both scipy's."""
    logs = np.log([s / p for s, p in zip(side, plain) if s > 0 and p > 0])
    boot = stats.bootstrap((logs,), _trimmed_mean, n_resamples=RESAMPLES, confidence_level=0.95,
                           method="percentile", rng=np.random.default_rng(seed))
    low, high = boot.confidence_interval
    return {"ratio": math.exp(_trimmed_mean(logs)), "interval": [math.exp(low), math.exp(high)], "rounds": len(logs),
            "side_s": statistics.median(side), "plain_s": statistics.median(plain)}


def verdict(interval: list[float], target: float) -> str:
    low, high = interval
    if high < target:
        return "yes"
    if low > target:
        return "no"
    return f"no verdict (noise +-{noise(interval):.1f}%)"


def noise(interval: list[float]) -> float:
    """The interval's half-width, in percent of the ratio."""
    low, high = interval
    return 100 * (high - low) / 2


def detectable(intervals: list[list[float]], estimates: list[float], target: float, quantile: float = 0.9) -> float:
    """The smallest slowdown (fraction of the plain step) that reads "no" in `quantile` of runs like these:
    the target's margin plus the `quantile` of how far an interval's lower end fell below its estimate."""
    below = sorted(estimate - interval[0] for estimate, interval in zip(estimates, intervals))
    return target - 1 + below[min(len(below) - 1, math.ceil(quantile * len(below)) - 1)]

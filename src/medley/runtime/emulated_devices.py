"""Emulated heterogeneity: run a plan for unlike devices on like ones (CPU ranks, one GPU type).

This is emulation, not measurement of the real devices: each rank stretches its compute by a
factor, sleeping ``(factor - 1) x`` the measured time of every compute action right after it
(:class:`medley.runtime.executor.RankExecutor`). Communication and optimizer steps are not
stretched. The default factor of a device is the plan's fastest device's peak FLOP/s (in the
plan's dtype) over its own, so the fastest device runs at full speed.
"""

from __future__ import annotations

from collections.abc import Mapping

from medley.errors import MedleyInputError
from medley.plan.plan import Plan


def slowdown_factors(plan: Plan, overrides: Mapping[int, float] | None = None) -> dict[int, float]:
    """Factor per device id of the plan (>= 1 by default; overrides are taken as given)."""
    devices = plan.cluster.devices
    used = sorted(plan.devices)  # every device of every TP group
    peaks = {d: devices[d].type.peak_flops(plan.shared.dtype) for d in used}
    fastest = max(peaks.values())
    factors = {d: fastest / peak for d, peak in peaks.items()}
    for device, factor in (overrides or {}).items():
        if device not in factors:
            raise MedleyInputError(f"--slowdown names device {device}, which the plan does not use "
                                   f"(it uses {used})")
        if factor < 1.0:
            raise MedleyInputError(f"--slowdown {device}={factor}: a factor must be >= 1 (1 = full speed)")
        factors[device] = float(factor)
    return factors

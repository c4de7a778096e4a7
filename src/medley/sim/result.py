"""What one simulated step reports.

Time accounting per device (all over the same ``step_time_s``, which runs from 0 to the end of the
last action anywhere):

* ``busy_s``: time the compute stream runs F, B, W, BW or OPTIM.
* ``idle_s = step_time_s - busy_s``, split by position into ``head_idle_s`` (before the device's
  first compute action), ``interior_idle_s`` (between its first and last) and ``tail_idle_s``
  (after its last, until the step ends).
* ``exposed_comm_s``: the part of the idle time the compute stream spends waiting on
  communication: for each compute action, how much later it starts than it would if every
  transfer and collective it waits on took zero time (its wait past the producer's end, or past
  everything but the ZeRO collective), plus collectives still running after the device's last
  compute action. Split into ``exposed_p2p_s`` and ``exposed_zero_s``.
* ``bubble_fraction = (idle_s - exposed_comm_s) / step_time_s``: idle time caused by the
  schedule itself. With communication off it is ``1 - busy/step``, which equals
  (p-1)/(m+p-1) for GPipe and 1F1B and (p-1)/(v·m+p-1) for interleaved in the homogeneous case.
"""

from __future__ import annotations

from dataclasses import dataclass

from medley.schedule.ir import Action, Kind

Transfer = tuple[int, int, float, float, int, Kind, int, int]
"""(src device, dst device, start, end, replica, SEND_F or SEND_B, sending stage, micro-batch)."""


@dataclass(kw_only=True, slots=True)
class DeviceReport:
    """Time and memory of one device over the step.

    Attributes:
        device: global device id.
        replica: DP replica it serves.
        rank: pipeline rank within that replica.
        busy_s, idle_s, head_idle_s, interior_idle_s, tail_idle_s: see the module docstring.
        exposed_p2p_s: idle time waiting on pipeline transfers.
        exposed_zero_s: idle time waiting on ZeRO collectives.
        static_memory_bytes: resident all step (from the problem).
        peak_memory_bytes: highest static + transient memory at any instant.
    """

    device: int
    replica: int
    rank: int
    busy_s: float
    idle_s: float
    head_idle_s: float
    interior_idle_s: float
    tail_idle_s: float
    exposed_p2p_s: float
    exposed_zero_s: float
    static_memory_bytes: float
    peak_memory_bytes: float
    step_time_s: float

    @property
    def exposed_comm_s(self) -> float:
        return self.exposed_p2p_s + self.exposed_zero_s

    @property
    def busy_fraction(self) -> float:
        return self.busy_s / self.step_time_s if self.step_time_s > 0 else 0.0

    @property
    def idle_fraction(self) -> float:
        return self.idle_s / self.step_time_s if self.step_time_s > 0 else 0.0

    @property
    def bubble_fraction(self) -> float:
        if self.step_time_s <= 0:
            return 0.0
        return max(0.0, self.idle_s - self.exposed_comm_s) / self.step_time_s


@dataclass(kw_only=True, slots=True)
class StageZeroReport:
    """ZeRO communication of one (global) stage, the worst device that runs it.

    Attributes:
        stage: global (virtual) stage index.
        comm_s: summed duration of the stage's collectives on that device.
        exposed_s: how much of the device's compute waited on them (plus any tail after its last
            compute action).
    """

    stage: int
    comm_s: float
    exposed_s: float


@dataclass(kw_only=True, slots=True)
class SimResult:
    """One simulated training step.

    Attributes:
        step_time_s: end of the last action anywhere (the step starts at 0).
        devices: per device, in the order of ``SimProblem.devices`` (replica-major).
        zero: per stage with ZeRO collectives.
        tokens_per_s: ``tokens_per_step / step_time_s``.
        mfu: ``model_flops_per_step / (step_time_s * sum of peak FLOP/s of all devices)``.
        compute: ``compute[device]`` = (start, end, action) of each compute action, in run order.
        transfers: one :data:`Transfer` per pipeline transfer, in the order they were sent.
        collectives: (member devices, start, end, action) per collective instance.
        memory: ``memory[device]`` = (times, bytes): the memory level from each time on.
        link_names: names of the links transfers and collectives crossed.
    """

    step_time_s: float
    devices: list[DeviceReport]
    zero: dict[int, StageZeroReport]
    tokens_per_s: float
    mfu: float
    compute: dict[int, list[tuple[float, float, Action]]]
    transfers: list[Transfer]
    collectives: list[tuple[tuple[int, ...], float, float, Action]]
    memory: dict[int, tuple[list[float], list[float]]]
    link_names: list[str]

    @property
    def bubble_fraction(self) -> float:
        """Schedule-caused idle time over all devices: sum of idle minus exposed, over devices x step."""
        if self.step_time_s <= 0 or not self.devices:
            return 0.0
        wasted = sum(max(0.0, d.idle_s - d.exposed_comm_s) for d in self.devices)
        return wasted / (len(self.devices) * self.step_time_s)

    @property
    def peak_memory_bytes(self) -> dict[int, float]:
        return {d.device: d.peak_memory_bytes for d in self.devices}

    def device(self, device_id: int) -> DeviceReport:
        for report in self.devices:
            if report.device == device_id:
                return report
        raise KeyError(f"device {device_id} is not in this simulation")

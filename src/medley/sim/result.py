"""What one simulated step reports.

Time accounting per device (all over the same ``step_time_s``, which runs from 0 to the end of the
last action anywhere). The step splits into parts that sum to ``step_time_s`` exactly (up to
rounding), each attributed to one cause:

* ``busy_s`` (compute): the compute stream runs F, B, W, BW or OPTIM.
* ``bubble_s``: idle because other devices have not got there yet: waiting for another pipeline
  stage to produce an activation or gradient (fill, drain, a slower neighbour), waiting for the
  other members of a ZeRO collective to issue it (a slower replica), and the tail after the
  device's last action until the step ends.
* ``exposed_transfer_s``: waiting for an incoming transfer past the end of the action that
  produced it (the transfer's own time, and any queueing on links or the sender's p2p stream).
* ``exposed_zero_s``: idle while one of the device's own ZeRO collectives (UNSHARD, REDUCE_GRAD of
  its stages) runs, when that collective, or one the compute stream waits for behind it on the
  device's collective stream, blocks the next compute action, or it still runs after the device's
  last compute action. Never more than the sum of those collectives' durations.
* ``exposed_clip_s``: the same for the world-wide gradient-norm all-reduce (CLIP) while it runs.
* ``clip_barrier_s``: waiting at CLIP for the other ranks to reach it (before it starts).

``idle_s = step_time_s - busy_s`` is also split by position into ``head_idle_s`` (before the
device's first compute action), ``interior_idle_s`` (between its first and last) and
``tail_idle_s`` (after its last, until the step ends).

How a wait is cut between causes: a compute action's wait is first a wait for its data (bubble up
to the producer's end, exposed transfer from there to the arrival), then, past the data's
arrival, a wait for the collective it depends on (UNSHARD before F/B, REDUCE_GRAD or CLIP before
OPTIM), laid over the device's collectives as above. With communication off the bubble fraction
``bubble_s / step_time_s`` is ``1 - busy/step``, which equals (p-1)/(m+p-1) for GPipe and 1F1B and
(p-1)/(v·m+p-1) for interleaved in the homogeneous case.
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
        busy_s: time its compute stream runs (the "compute" part).
        idle_s: ``step_time_s - busy_s``.
        head_idle_s, interior_idle_s, tail_idle_s: ``idle_s`` by position (the module docstring).
        bubble_s: idle waiting for other devices (the module docstring).
        exposed_transfer_s: idle waiting on incoming pipeline transfers past their producer's end.
        exposed_zero_s: idle while the device's own ZeRO collectives run and block it.
        exposed_clip_s: idle while the gradient-norm all-reduce (CLIP) runs and blocks it.
        clip_barrier_s: idle at CLIP waiting for the other ranks to reach it.
        static_memory_bytes: resident all step (from the problem).
        peak_memory_bytes: highest static + transient memory at any instant.
        step_time_s: the step's length, the same for every device.
        tp: size of the tensor-parallel group running the rank (1: none); tp_rank: this device's
            rank in it (0: the lead the simulator ran; the others are its copies).
    """

    device: int
    replica: int
    rank: int
    busy_s: float
    idle_s: float
    head_idle_s: float
    interior_idle_s: float
    tail_idle_s: float
    bubble_s: float
    exposed_transfer_s: float
    exposed_zero_s: float
    exposed_clip_s: float
    clip_barrier_s: float
    static_memory_bytes: float
    peak_memory_bytes: float
    step_time_s: float
    tp: int = 1
    tp_rank: int = 0

    @property
    def label(self) -> str:
        """``r<replica> k<rank>``, with ``tp<j>/<t>`` on a tensor-parallel group."""
        return f"r{self.replica} k{self.rank}" + (f" tp{self.tp_rank}/{self.tp}" if self.tp > 1 else "")

    @property
    def exposed_comm_s(self) -> float:
        """Idle time while the device's communication runs: transfers, ZeRO and CLIP."""
        return self.exposed_transfer_s + self.exposed_zero_s + self.exposed_clip_s

    @property
    def parts(self) -> dict[str, float]:
        """The step's parts on this device, which sum to ``step_time_s``."""
        return {
            "compute": self.busy_s, "bubble": self.bubble_s, "exposed_transfer": self.exposed_transfer_s,
            "exposed_zero": self.exposed_zero_s, "exposed_clip": self.exposed_clip_s,
            "clip_barrier": self.clip_barrier_s,
        }

    @property
    def busy_fraction(self) -> float:
        return self.busy_s / self.step_time_s if self.step_time_s > 0 else 0.0

    @property
    def idle_fraction(self) -> float:
        return self.idle_s / self.step_time_s if self.step_time_s > 0 else 0.0

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_s / self.step_time_s if self.step_time_s > 0 else 0.0


@dataclass(kw_only=True, slots=True)
class StageZeroReport:
    """ZeRO communication of one (global) stage, the worst device that runs it.

    Attributes:
        stage: global (virtual) stage index.
        comm_s: summed duration of the stage's ZeRO collectives on a device that runs it (the
            largest over those devices); CLIP is not a ZeRO collective and counts in no stage.
        exposed_s: the largest over those devices of its ``exposed_zero_s`` spent in this stage's
            collectives; at most ``comm_s``.
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
        executed_ops: ops the engine executed: compute actions, sends (lowered SENDs and those
            implied after a compute action), collective issues and local ZeRO actions. RECVs
            are not executed (receives are posted early), so this is what speed is measured in.
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
    executed_ops: int

    @property
    def bubble_fraction(self) -> float:
        """Bubble time over all devices, over devices x step."""
        if self.step_time_s <= 0 or not self.devices:
            return 0.0
        return sum(d.bubble_s for d in self.devices) / (len(self.devices) * self.step_time_s)

    @property
    def peak_memory_bytes(self) -> dict[int, float]:
        return {d.device: d.peak_memory_bytes for d in self.devices}

    def device(self, device_id: int) -> DeviceReport:
        for report in self.devices:
            if report.device == device_id:
                return report
        raise KeyError(f"device {device_id} is not in this simulation")

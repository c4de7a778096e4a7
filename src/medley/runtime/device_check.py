"""Whether this machine has the devices a plan puts on it: checked, never assumed.

A plan whose devices on a node are GPU types (every catalog type but the CPU ones: ``CPU-8GB`` and
the emulated ``CPU-x2`` kinds) needs, on that node, a CUDA build of torch that sees one GPU of the
planned type per plan device (local rank i on the i-th visible GPU). Without it the ranks would fall
back to gloo on the CPU and train there silently; :func:`device_problems` says instead, one line
per problem, naming the node, the planned type, what was found and the fix. ``medley train`` runs
it before any rank starts (``--local-ranks``) or, under torchrun, in each rank before it joins the
process group; ``medley doctor`` prints it per node and ``medley launch`` puts the doctor in front of
every node's command. ``--emulate`` and ``--device cpu`` are the ways to run a GPU plan on a CPU.

The pure part (plan and :class:`NodeDevices` to problems) imports no torch: tests inject what a
node has; :func:`probe` measures this machine.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from medley.plan.plan import Plan
from medley.runtime.placement import plan_devices, plan_devices_by_node
from medley.spec.catalog import DeviceType, cuda_mismatch
from medley.spec.cluster_schema import printable

# The README's set-up, as the fix of every "no CUDA here" line.
CUDA_FIX = ("install a CUDA build of torch: MEDLEY_TORCH=cu128 scripts/venv.sh (README, \"GPU set-up\"; "
            "auto-detected where nvidia-smi lists a GPU)")
CPU_CHOICE = "or run on the CPU on purpose with --emulate or --device cpu"
DEVICE_CHOICES = ("auto", "cpu")


@dataclass(frozen=True, kw_only=True)
class LocalGpu:
    """One GPU as CUDA reports it on this machine.

    Attributes:
        index: its CUDA index (after ``CUDA_VISIBLE_DEVICES``).
        name: ``torch.cuda.get_device_name``.
        memory_bytes: its total memory.
    """

    index: int
    name: str
    memory_bytes: int


@dataclass(frozen=True, kw_only=True)
class NodeDevices:
    """What this machine's torch can compute on.

    Attributes:
        torch_version: ``torch.__version__`` (``2.13.0+cpu`` for a CPU build).
        cuda_version: ``torch.version.cuda``; None: a build without CUDA.
        gpus: the GPUs CUDA sees, by index (empty without CUDA or without a visible GPU).
        nccl_version: NCCL's version as ``2.27.3``; None without CUDA.
    """

    torch_version: str
    cuda_version: str | None
    gpus: tuple[LocalGpu, ...] = ()
    nccl_version: str | None = None

    def describe(self) -> str:
        """What was found, for messages: ``torch 2.13.0+cpu (a CPU build)``, or its CUDA and GPUs."""
        if self.cuda_version is None:
            return f"torch {self.torch_version} (a CPU build, no CUDA)"
        if not self.gpus:
            return f"torch {self.torch_version} with CUDA {self.cuda_version} but no visible GPU"
        names = ", ".join(f"cuda:{g.index} {printable(g.name)}" for g in self.gpus[:8])
        return f"torch {self.torch_version} with CUDA {self.cuda_version}: {names}"


def probe() -> NodeDevices:
    """This machine's torch build and GPUs (and NCCL's version with CUDA)."""
    import torch

    gpus: tuple[LocalGpu, ...] = ()
    nccl = None
    if torch.version.cuda is not None and torch.cuda.is_available():
        gpus = tuple(LocalGpu(index=i, name=torch.cuda.get_device_name(i),
                              memory_bytes=torch.cuda.get_device_properties(i).total_memory)
                     for i in range(torch.cuda.device_count()))
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return NodeDevices(torch_version=str(torch.__version__), cuda_version=torch.version.cuda, gpus=gpus,
                       nccl_version=nccl)


def is_cpu_type(device: DeviceType) -> bool:
    """A CPU stand-in rather than a GPU: the catalog's CPU core (and its aliases) and the emulated
    ``CPU-x<factor>`` types (a per-node override is named ``BASE@node``)."""
    names = (device.name.split("@")[0], *device.aliases)
    return any(name.upper() == "CPU" or name.upper().startswith("CPU-") for name in names)


def planned_here(plan: Plan, node: str | None) -> list[int]:
    """The plan devices on ``node`` in local-rank order (None: this machine plays every node)."""
    return plan_devices(plan) if node is None else plan_devices_by_node(plan).get(node, [])


def gpu_devices(plan: Plan, node: str | None) -> list[int]:
    """The plan devices on ``node`` (None: all) whose type is a GPU type."""
    return [d for d in planned_here(plan, node) if not is_cpu_type(plan.cluster.devices[d].type)]


def planned_types(plan: Plan, devices: Sequence[int]) -> str:
    """``4 x A100-80GB (devices 0-3)`` for messages."""
    by_type: dict[str, list[int]] = {}
    for device in devices:
        by_type.setdefault(plan.cluster.devices[device].type.name.split("@")[0], []).append(device)
    return ", ".join(f"{len(ids)} x {name} (device{'s' if len(ids) > 1 else ''} {_ids(ids)})"
                     for name, ids in by_type.items())


def _ids(ids: Sequence[int]) -> str:
    if len(ids) > 2 and list(ids) == list(range(ids[0], ids[-1] + 1)):
        return f"{ids[0]}-{ids[-1]}"
    return ",".join(map(str, ids[:16]))


def where(node: str | None) -> str:
    """``node 'a100'``, or this machine when it plays every node."""
    return "this machine (playing every node)" if node is None else f"node '{printable(node)}'"


def device_problems(plan: Plan, found: NodeDevices, *, node: str | None) -> list[str]:
    """Why ``found`` cannot run the plan's devices on ``node`` (None: every node, as ``--local-ranks``
    does), one line each; empty when it can (or when the plan puts only CPU types there)."""
    devices = planned_here(plan, node)
    gpus = gpu_devices(plan, node)
    if not gpus:
        return []
    head = f"{where(node)}: the plan puts {planned_types(plan, gpus)} here"
    if not found.gpus:
        return [f"{head} but found {found.describe()}; {CUDA_FIX}"]
    if len(found.gpus) < len(devices):
        return [f"{head} ({len(devices)} rank(s)) but CUDA sees {len(found.gpus)} GPU(s) "
                f"({found.describe()}); run on a node with {len(devices)} GPUs or make them visible "
                "(CUDA_VISIBLE_DEVICES)"]
    problems = []
    for local_rank, device in enumerate(devices):
        planned, gpu = plan.cluster.devices[device].type, found.gpus[local_rank]
        if is_cpu_type(planned):
            continue
        why = cuda_mismatch(planned, gpu.name, gpu.memory_bytes)
        if why is not None:
            problems.append(f"{where(node)}: plan device {device} ({planned.name}) is local rank "
                            f"{local_rank} but cuda:{gpu.index} is '{printable(gpu.name)}' with "
                            f"{gpu.memory_bytes / 1e9:.1f} GB: {why}; run on the planned GPUs or re-plan "
                            "for this node's devices")
    return problems

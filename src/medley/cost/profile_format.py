"""medley's measured profile file: its schema (one JSON file per model, device and dtype), and
reading and writing it.

``medley profile`` writes one JSON file per (model, device, dtype): per layer kind (embedding,
block, head) and per (micro-batch size, sequence length) the measured F, B and W times (B and W
split exactly as the runtime splits them) and the activation bytes the layer holds; plus, when
collectives were measured, the raw timings over the backend and their α-β fit. The file names
the device, the torch version, the date and the host, and carries ``version``; a reader refuses
versions it does not know. :mod:`medley.cost.profiles` answers layer costs from it.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, Strict, StrictFloat, StrictInt, ValidationError, model_validator

from medley.errors import MedleyInputError
from medley.fileio import read_user_text, write_atomically
from medley.spec.cluster_schema import STRICT, describe_validation_error, printable
from medley.spec.limits import MAX_SIZE
from medley.spec.model import ModelSpec, model_from_dict

PROFILE_FORMAT = "medley-profile"
PROFILE_VERSION = 1
PROFILE_DOC = ("the module docstring of medley/cost/profile_format.py "
               "(re-create the file with `medley profile`)")
LayerKindName = Literal["embedding", "block", "head"]


class LayerMeasurement(BaseModel):
    """One layer kind at one shape: medians over the timed runs.

    ``backward_full_s`` is the fused backward (one autograd call, what 1F1B runs); B + W is the
    split backward of zero-bubble schedules. ``activation_bytes`` is what the layer's forward
    leaves alive for its backward (saved tensors and its output), ``activation_after_b_bytes``
    what is still alive between B and W, ``backward_workspace_bytes`` the transient peak of the
    backward beyond that (gradients of intermediates, temporaries). ``fsdp_*``: the same layer
    wrapped by FSDP2 as ZeRO-2/3 stages are (hooks and bookkeeping, no communication); ``tp_*``:
    a block under torch's tensor parallelism on a one-rank mesh (DTensor dispatch, no
    communication; blocks only).
    """

    model_config = STRICT
    kind: LayerKindName
    micro_batch_size: int = Field(ge=1, le=MAX_SIZE)
    seq_len: int = Field(ge=1, le=MAX_SIZE)
    forward_s: float = Field(gt=0)
    backward_input_s: float = Field(ge=0)
    backward_weight_s: float = Field(ge=0)
    backward_full_s: float = Field(gt=0)
    activation_bytes: float = Field(ge=0)
    activation_after_b_bytes: float = Field(ge=0)
    backward_workspace_bytes: float = Field(default=0.0, ge=0)
    fsdp_forward_s: float | None = Field(default=None, gt=0)
    fsdp_backward_full_s: float | None = Field(default=None, gt=0)
    tp_forward_s: float | None = Field(default=None, gt=0)
    tp_backward_full_s: float | None = Field(default=None, gt=0)
    runs: int = Field(ge=1)

    @model_validator(mode="after")
    def _split_backward(self) -> LayerMeasurement:
        """A measured time is never 0 (all-zero times divided by zero in the planner)."""
        if self.backward_input_s + self.backward_weight_s <= 0:
            raise ValueError("backward_input_s + backward_weight_s must be > 0 (measured times)")
        return self


class CommMeasurement(BaseModel):
    """Median time of one collective (or a send/recv pair) over ``ranks`` ranks.

    ``nbytes`` is the full (unsharded) buffer, as :class:`CommModel` counts it."""

    model_config = STRICT
    op: Literal["send_recv", "all_gather", "reduce_scatter", "all_reduce"]
    ranks: int = Field(ge=2)
    nbytes: float = Field(gt=0)
    seconds: float = Field(gt=0)


class AlphaBeta(BaseModel):
    """Latency per message step (s) and bandwidth (bytes/s) of the ring/α-β model."""

    model_config = STRICT
    latency_s: float = Field(ge=0)
    bandwidth_bytes_per_s: float = Field(gt=0)
    median_rel_error: float = Field(ge=0)


class CommProfile(BaseModel):
    model_config = STRICT
    backend: str
    measurements: list[CommMeasurement]
    fits: dict[str, AlphaBeta]  # per op, over every group size
    link: AlphaBeta  # one fit over every op and group size
    # one fit over every op, per group size ("2", "4")
    link_by_ranks: dict[Annotated[str, Field(pattern=r"^[0-9]{1,6}$")], AlphaBeta] = {}

    def link_for(self, ranks: int) -> AlphaBeta:
        """The fit for a cluster link of ``ranks`` devices: that group size's, else the nearest
        measured one (ranks sharing too few cores queue up, so the group size matters)."""
        if not self.link_by_ranks:
            return self.link
        nearest = min(self.link_by_ranks, key=lambda k: (abs(int(k) - ranks), -int(k)))
        return self.link_by_ranks[nearest]


class OptimizerProfile(BaseModel):
    """One optimizer step's time, fitted as ``fixed_s + per_param_s * params`` over the layer kinds."""

    model_config = STRICT
    name: str
    fixed_s: float = Field(ge=0)
    per_param_s: float = Field(ge=0)
    # (parameters, median seconds); JSON writes the pairs as lists
    measurements: list[Annotated[tuple[StrictInt, StrictFloat], Strict(False)]] = []


class OverheadProfile(BaseModel):
    """What medley's runtime pays beyond the profiled layers and the link (see
    :mod:`medley.profile.overhead`): ``action_s`` per compute action (the executor's bookkeeping),
    ``p2p_handoff_s`` per point-to-point transfer (one gloo hand-off beyond the link's α-β time),
    ``collective_s`` per ZeRO collective call (FSDP2's copies and bookkeeping around a gather or
    a reduction beyond the link's α-β time; 0 in profiles that predate it);
    ``figures``: the measurements they come from."""

    model_config = STRICT
    action_s: float = Field(ge=0)
    p2p_handoff_s: float = Field(ge=0)
    collective_s: float = Field(default=0.0, ge=0)
    figures: dict[str, Any] = {}


class Profile(BaseModel):
    """A profile file's contents (see the module docstring). ``overhead`` is absent in profiles
    written before it was measured: those predict no overhead. ``compiled``: the blocks' times
    (and the FSDP2 and TP ones) were measured with the blocks compiled, as ``medley train
    --compile`` runs them (``medley profile --compile``); the embedding and the head are eager in
    both."""

    model_config = STRICT
    format: Literal["medley-profile"]
    version: int
    created: str
    host: str
    device_type: str = Field(min_length=1)
    device_kind: Literal["cpu", "cuda"]
    device_detail: str = ""
    torch_version: str
    dtype: Literal["fp32", "bf16", "fp16"]
    threads: int = Field(ge=1)
    model: dict[str, Any]
    layers: list[LayerMeasurement] = Field(min_length=1)
    comm: CommProfile | None = None
    optimizer: OptimizerProfile | None = None
    overhead: OverheadProfile | None = None
    compiled: bool = False
    notes: str = ""
    provenance: dict[str, str] = {}  # a bench's profile: the commit and command that wrote it

    def model_spec(self) -> ModelSpec:
        return model_from_dict(self.model, source="profile table 'model'", doc=PROFILE_DOC)


def model_dict(model: ModelSpec) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(model).items() if v is not None}


def save_profile(profile: Profile, path: Path) -> None:
    """Write ``profile`` as JSON; the file appears whole or not at all."""
    write_atomically(Path(path), json.dumps(profile.model_dump(mode="json"), indent=1) + "\n")


def read_versioned_json(path: Path, *, what: str, flag: str, file_format: str, version: int,
                        writer: str) -> dict[str, Any]:
    """The JSON object of a file medley wrote (a profile, a communication profile) once its
    ``format`` and ``version`` fields match; every problem is one :class:`MedleyInputError` line
    naming ``path``, what it should be, and ``writer`` (the command that writes one)."""
    text = read_user_text(Path(path), what=what, fix=f"give a file written by `{writer}`", flag=flag)
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as err:
        raise MedleyInputError(f"{path}: not a JSON {what} ({printable(err)}); give a file written by "
                               f"`{writer}`.") from None
    if not isinstance(raw, dict) or raw.get("format") != file_format:
        raise MedleyInputError(f"{path}: field 'format' must be '{file_format}'; give a file written by "
                               f"`{writer}`.")
    if raw.get("version") != version:
        raise MedleyInputError(
            f"{path}: field 'version' is {printable(repr(raw.get('version')))}; this medley reads "
            f"version {version}. Re-create it with `{writer}`.")
    return raw


def load_profile(path: Path) -> Profile:
    """Read and validate a profile file; every problem is a :class:`MedleyInputError`."""
    raw = read_versioned_json(path, what="profile file", flag="--profile", file_format=PROFILE_FORMAT,
                              version=PROFILE_VERSION, writer="medley profile")
    try:
        profile = Profile.model_validate(raw)
    except ValidationError as err:
        raise MedleyInputError(describe_validation_error(err, str(path), doc=PROFILE_DOC)) from None
    model_from_dict(profile.model, source=f"{path} [model]", doc=PROFILE_DOC)
    return profile

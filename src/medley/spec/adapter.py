"""LoRA adapters (Hu et al., 2021), the one definition the planner, the simulator and the runtime
read: which of a block's linear layers get an adapter, its rank and scale, and what that leaves
trainable.

A target linear layer ``y = x W^T + b`` becomes ``y = x W^T + b + (alpha / rank) B A dropout(x)``
with ``A`` [rank, in] and ``B`` [out, rank] (PEFT's ``lora_A`` / ``lora_B``; ``B`` starts at zero,
so the adapted model starts as the base). Only the adapters train: the base weights (embedding,
norms, head and every block matrix) are frozen, so they take no gradient and no optimizer state,
and their weight-gradient matmuls are skipped (:mod:`medley.cost.formulas` prices that).
"""

from __future__ import annotations

from dataclasses import dataclass

from medley.errors import MedleyInputError
from medley.spec.model import ModelSpec

# medley's block linear layers (runtime/transformer.py) and the Hugging Face module names PEFT
# targets for them (Llama/Mistral/Qwen2 names; GPT-2 style models use others and are refused).
HF_NAMES = {"wq": "q_proj", "wk": "k_proj", "wv": "v_proj", "wo": "o_proj",
            "gate": "gate_proj", "up": "up_proj", "down": "down_proj"}
# Row-wise (input-sharded) layers under tensor parallelism; the rest are column-wise.
ROWWISE = frozenset({"wo", "down"})
DEFAULT_TARGETS = ("wq", "wk", "wv", "wo", "gate", "up", "down")


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraSpec:
    """A LoRA adapter on some of every block's linear layers.

    Attributes:
        rank: r, the adapter's inner width.
        alpha: the scale's numerator: the adapter's output is multiplied by ``alpha / rank``.
        dropout: dropout on the adapter's input (training only).
        targets: the block linear layers adapted, by medley's names (``wq wk wv wo gate up down``).
    """

    rank: int
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {self.rank}")
        unknown = [t for t in self.targets if t not in HF_NAMES]
        if unknown or not self.targets:
            raise ValueError(f"LoRA targets {unknown or '(none)'}: choose among {', '.join(HF_NAMES)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def targets_of(self, model: ModelSpec) -> tuple[str, ...]:
        """The targets ``model`` has (a GELU MLP has no ``gate``)."""
        return tuple(t for t in self.targets if t != "gate" or model.mlp == "swiglu")

    def block_params(self, model: ModelSpec) -> int:
        """Adapter parameters of one block: r (in + out) per target (:meth:`held_params` at tp 1)."""
        return int(self.held_params(model))

    def held_params(self, model: ModelSpec, *, tp: int = 1) -> float:
        """Adapter parameters of one block that each device of a TP group of ``tp`` holds: a
        column-wise layer's ``A`` whole and ``B`` cut, a row-wise layer's ``A`` cut and ``B``
        whole (:mod:`medley.runtime.lora`)."""
        shapes = linear_shapes(model)
        held = 0.0
        for target in self.targets_of(model):
            fan_in, fan_out = shapes[target]
            held += self.rank * (fan_in / tp + fan_out if target in ROWWISE else fan_in + fan_out / tp)
        return held

    def as_json(self) -> dict[str, object]:
        return {"rank": self.rank, "alpha": self.alpha, "dropout": self.dropout,
                "targets": list(self.targets)}


def linear_shapes(model: ModelSpec) -> dict[str, tuple[int, int]]:
    """(in, out) features of each block linear layer."""
    h, q, kv, f = model.hidden_size, model.q_dim, model.kv_dim, model.ffn_hidden_size
    return {"wq": (h, q), "wk": (h, kv), "wv": (h, kv), "wo": (q, h), "gate": (h, f), "up": (h, f),
            "down": (f, h)}


def parse_targets(text: str, *, flag: str = "--lora-targets") -> tuple[str, ...]:
    """``"q,v"``, ``"q_proj,v_proj"``, ``"wq,wv"`` or ``"all"`` as medley's layer names."""
    by_name = {**{k: k for k in HF_NAMES}, **{v: k for k, v in HF_NAMES.items()},
               **{k.removeprefix("w"): k for k in HF_NAMES if k.startswith("w")}}
    if text.strip() in ("all", "all-linear"):
        return DEFAULT_TARGETS
    names = [part.strip() for part in text.split(",") if part.strip()]
    unknown = [n for n in names if n not in by_name]
    if unknown or not names:
        raise MedleyInputError(f"{flag} '{text[:60]}': unknown layer {unknown[0] if unknown else '(none)'}; "
                               "give a comma list of q,k,v,o,gate,up,down (or q_proj, ...; or all)")
    return tuple(dict.fromkeys(by_name[n] for n in names))


def lora_of(*, rank: int, alpha: float, dropout: float, targets: str, model: ModelSpec) -> LoraSpec | None:
    """The adapter the ``--lora-*`` flags describe for ``model``; None with rank 0 (full
    fine-tuning). Bad values are one line naming the flag."""
    if rank == 0:
        return None
    if rank < 0:
        raise MedleyInputError(f"--lora-rank {rank}: give a rank >= 1 (0: no adapter, full fine-tuning)")
    if not 0.0 <= dropout < 1.0:
        raise MedleyInputError(f"--lora-dropout {dropout}: give a value in [0, 1)")
    if model.mlp != "swiglu" or model.bias:
        raise MedleyInputError(f"--lora-rank: model '{model.name}' has no Llama-style (q/k/v/o, "
                               "gate/up/down) linear layers; LoRA is supported for Llama, Mistral and "
                               "Qwen2 style models")
    return LoraSpec(rank=rank, alpha=alpha, dropout=dropout, targets=parse_targets(targets))


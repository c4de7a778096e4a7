"""Activation recomputation of a stage's blocks: the one definition the runtime applies and the cost
model, the memory model, the simulator's compiler and the planner read.

A stage's :class:`Recompute` names a mode and how many of the stage's blocks (the first ``blocks``,
in layer order) it applies to; the others keep every activation. Embedding and head never
recompute. The modes:

* ``none``: a block keeps what autograd saves for its backward.
* ``full``: a block keeps only its input and reruns its whole forward inside its backward
  (``torch.utils.checkpoint``, non-reentrant).
* ``selective``: torchtitan's per-op policy (``torchtitan.distributed.activation_checkpoint``,
  ``_save_list``) with torch's selective checkpoint contexts: a block keeps its input and the
  outputs of the ops in :data:`SAVED_OPS`, every weight matmul (q, k, v, attention output, gate,
  up, down: ``aten.mm``/``aten.addmm``) and the attention kernel (its output and log-sum-exp), and
  reruns the cheap ops (norms, RoPE, the GQA repeat, the MLP activation, residual adds, casts,
  copies) inside its backward. Unlike torchtitan, which also recomputes every second matmul, every
  matmul is saved: the rerun then costs only memory-bound work.

What each mode keeps per block is :func:`medley.cost.formulas.layer_activation_bytes`, what its
backward holds again is :func:`medley.cost.formulas.layer_rerun_bytes`, and the share of a block's
forward time it reruns is :func:`rerun_share`: the source's forward time (measured where a profile
has it) times the catalog roofline's share of memory-bound work in it, an estimate; no profile
measures a selective block's rerun yet. On CPU with tiny blocks the selective contexts' dispatch
modes cost Python time per op that this leaves out (bench/results/fidelity.md, the tiny-pp2-selective cases).
"""

from __future__ import annotations

from dataclasses import dataclass

from medley.errors import MedleyInputError

MODES = ("none", "full", "selective")

# The ops (aten overload names) whose outputs a selective block saves; the runtime maps them to
# torch's OpOverloads (medley.runtime.transformer), the formulas count their outputs.
SAVED_OPS = (
    "aten.mm.default",
    "aten.addmm.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
)


@dataclass(frozen=True, slots=True)
class Recompute:
    """A stage's recomputation: ``mode`` (one of :data:`MODES`) on the stage's first ``blocks``
    blocks (None: all of them), the rest kept whole. True when any block recomputes.

    Text form (plan files, ``--recompute``): ``none``, ``full``, ``selective``, or ``MODE:K`` for
    the first K blocks (``full:2``)."""

    mode: str = "none"
    blocks: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"recompute mode '{self.mode}' is not one of {', '.join(MODES)}")
        if self.blocks is not None and self.blocks < 0:
            raise ValueError(f"recompute blocks must be >= 0, got {self.blocks}")
        if self.mode == "none" and self.blocks is not None:
            raise ValueError("recompute 'none' takes no block count")

    def __bool__(self) -> bool:
        return self.mode != "none" and self.blocks != 0

    def mode_of(self, position: int) -> str:
        """The mode of the stage's block ``position`` (0: its first block)."""
        if self.blocks is not None and position >= self.blocks:
            return "none"
        return self.mode

    def layer_modes(self, model_kinds: list[str]) -> list[str]:
        """Per layer of a stage (``model_kinds``: each layer's kind, in order), its mode."""
        out, position = [], 0
        for kind in model_kinds:
            if kind == "block":
                out.append(self.mode_of(position))
                position += 1
            else:
                out.append("none")
        return out

    def __str__(self) -> str:
        return self.mode if self.blocks is None else f"{self.mode}:{self.blocks}"


NONE = Recompute("none")
FULL = Recompute("full")
SELECTIVE = Recompute("selective")


def parse_recompute(value: object, *, where: str = "recompute") -> Recompute:
    """A :class:`Recompute` from a plan file's or a flag's value: a bool (the old form: True is
    ``full``), a :class:`Recompute`, or the text form. Bad input raises :class:`MedleyInputError`
    naming ``where``."""
    if isinstance(value, Recompute):
        return value
    if isinstance(value, bool):
        return FULL if value else NONE
    if isinstance(value, str):
        mode, _, count = value.strip().partition(":")
        try:
            return Recompute(mode, int(count) if count else None)
        except ValueError as exc:
            raise MedleyInputError(
                f"{where}: '{value}' is not a recomputation; write none, full, selective, or MODE:K "
                f"for a stage's first K blocks (full:2) ({exc})") from None
    raise MedleyInputError(f"{where}: {value!r} is not a recomputation; write true/false, none, full, "
                           "selective or MODE:K")


def recompute_text(setting: Recompute) -> str:
    """Words for a recomputation: 'full recomputation', 'selective recomputation of the first 2
    blocks', 'no recomputation'."""
    if not setting:
        return "no recomputation"
    text = f"{setting.mode} recomputation"
    return text if setting.blocks is None else f"{text} of the first {setting.blocks} blocks"


def recompute_mark(text: str) -> str:
    """A short mark of a recomputation's text form for tables: '' (none), 'r' (full), 's'
    (selective), with ':K' for the first K blocks."""
    setting = parse_recompute(text)
    if not setting:
        return ""
    mark = "r" if setting.mode == "full" else "s"
    return mark if setting.blocks is None else f"{mark}:{setting.blocks}"


def rerun_share(mode: str, *, forward_s: float, cheap_s: float) -> float:
    """Seconds a block's backward reruns of its forward under ``mode``: all of ``forward_s`` for
    ``full``, its memory-bound ops' seconds ``cheap_s`` for ``selective`` (what the catalog's
    roofline prices as non-matmul work, :meth:`medley.cost.estimator.CatalogCostSource.cheap_share`,
    scaled to the source's forward time), nothing for ``none``."""
    if mode == "full":
        return forward_s
    if mode == "selective":
        return min(forward_s, cheap_s)
    return 0.0

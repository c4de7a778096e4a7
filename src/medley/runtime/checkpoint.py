"""Checkpoints with torch.distributed.checkpoint (DCP), in a form no plan owns.

Keys are global: ``model.<parameter>`` (names such as ``blocks.2.attn.wq.weight`` do not depend
on the split), ``optim.<parameter>.<state>`` and ``train.next_step`` / ``train.rng``, plus the
loop's own ``train.<name>`` scalars (``train_state``: the skipped-step count, fp16's loss
scale), each restored when the checkpoint has it (an older one, or one of a bf16 run resumed in
fp16, keeps the run's starting values). Sharded
(ZeRO-1/2/3) tensors are saved as DTensors and replicated ones once (DCP drops the duplicates),
so DCP can load a checkpoint into any other plan: other
pp, dp, split or ZeRO levels. The data position is the step (batches are a function of it).

Each save goes to ``.tmp-step-N`` and is renamed to ``step-N`` once complete, so a crash mid-save
leaves the previous checkpoint intact; nothing is saved from non-finite tensors, and a failed
write (disk full) removes the temporary directory. ``medley.json`` beside the DCP files records
the model, optimizer, data order (seed, global batch, data), every tensor entry (key, dtype,
global shape) and a sha256 per file, all checked before any tensor is read
(:mod:`medley.runtime.checkpoint_verify`, which also says what the hashes protect against).
Loading never unpickles code and reads exactly the tensors this run's model and optimizer have.
Nothing medley writes or removes here follows a symbolic link: a ``step-N`` that is a link is
refused, and leftover ``.tmp-*`` / ``.old-*`` links are removed as links.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

from medley.errors import MedleyInputError
from medley.fileio import open_no_follow, os_error_message, remove_path
from medley.runtime import lock
from medley.runtime.checkpoint_layout import (
    KEEP,
    META_FILE,
    TEMP_PREFIX,
    checkpoint_path,
    step_directories,
)
from medley.runtime.checkpoint_verify import (
    FORMAT,
    check_entries,
    entry_of,
    failures_of,
    load_tensors,
    manifest_of,
    read_meta,
    resume_fix,
    sha256_of,
    verified_metadata,
)
from medley.runtime.optim import LrSchedule, ensure_state
from medley.runtime.settings import CheckpointConfig
from medley.runtime.sharding import ShardedStage

_SHARED_WAIT_S = 10.0  # how long a rank looks for rank 0's token (a shared file system's caches)


def checkpoint_state(stages: dict[int, ShardedStage], *, for_load: bool,
                     copies: bool = False) -> dict[str, torch.Tensor]:
    """This rank's tensors under their global keys (views: loading fills them in place).

    A tied weight's copy (``ShardedStage.copies``) has its original's keys: it is never saved
    (the original is, and the two are equal), and loaded apart (``copies``: only the copies'
    tensors, without the ``train.*`` ones), since a rank holding both would list a key twice."""
    state: dict[str, torch.Tensor] = {}
    for stage in stages.values():
        name_of = {}
        for name, param in stage.named_parameters_local():
            # A LoRA run's frozen base is read again from --init-from (or the seed): only the
            # adapters are saved.
            if (param in stage.copies) == copies and param.requires_grad:
                state[f"model.{name}"] = param.detach()
            name_of[param] = name
        for optimizer in stage.optimizers:
            if for_load and not copies:
                ensure_state(optimizer)
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if (param in stage.copies) != copies:
                        continue
                    for key, value in optimizer.state.get(param, {}).items():
                        if isinstance(value, torch.Tensor):
                            state[f"optim.{name_of[param]}.{key}"] = value
    if copies:
        return state
    state["train.next_step"] = torch.zeros((), dtype=torch.int64)
    state["train.rng"] = torch.get_rng_state()
    return state


def shared_error(error: str | None) -> str | None:
    """Collective: the first rank's error message, on every rank (None when no rank has one)."""
    gathered: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, error)
    return next((e for e in gathered if e), None)


def check_shared(directory: Path, token: str | None) -> None:
    """Collective: every rank sees rank 0's lock-file token in ``directory`` (``token`` is rank
    0's; other ranks pass None), or every rank raises one :class:`MedleyInputError` naming the
    ranks and hosts that do not. Every rank writes its shards into the step directory rank 0
    creates and rank 0 alone publishes it, so all nodes must share the directory."""
    shared = [token, str(directory)]  # rank 0's: every rank's message is the same line
    dist.broadcast_object_list(shared, src=0)
    seen = dist.get_rank() == 0
    deadline = time.monotonic() + _SHARED_WAIT_S
    while not seen:
        seen = lock.read_token(directory) == shared[0]
        if seen or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    gathered: list[tuple[bool, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (seen, socket.gethostname()))
    missing = [(rank, entry[1]) for rank, entry in enumerate(gathered) if entry is not None and not entry[0]]
    if missing:
        ranks = ", ".join(str(rank) for rank, _ in missing)
        hosts = ", ".join(sorted({host for _, host in missing}))
        where = Path(shared[1])
        raise MedleyInputError(
            f"--checkpoint-dir {where}: rank{'s' if len(missing) > 1 else ''} {ranks} (on {hosts}) do "
            f"not see the lock file rank 0 wrote there ({where / lock.LOCK_FILE}); every rank writes its "
            "shards into the directory and rank 0 publishes it, so all nodes need the same directory: give a "
            "--checkpoint-dir on a shared file system (NFS, Lustre, ...)")


def _hash_files(directory: Path, names: list[str]) -> dict[str, str]:
    """Collective: sha256 of each named file; every rank hashes its share, all get every hash."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = {name: sha256_of(directory / name) for name in sorted(names)[rank::world]}
    gathered: list[dict[str, str] | None] = [None] * world
    dist.all_gather_object(gathered, mine)
    return {name: digest for part in gathered for name, digest in (part or {}).items()}


def _checkpoint_files(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if p.is_file() and p.name != META_FILE)


def _non_finite(state: dict[str, torch.Tensor]) -> str | None:
    for key, value in state.items():
        if value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return key
    return None


def _write_failure(tmp: Path, err: BaseException) -> str:
    """One line for a failed save: the OSError (disk full names the free space) or, for a writer
    that failed without one (torch's zip writer says "unexpected pos"), its reason and the free space."""
    failures = failures_of(err)
    os_error = next((e for e in failures if isinstance(e, OSError)), None)
    if os_error is not None:
        return "checkpoint " + os_error_message(tmp, os_error)
    reason = str(failures[0]).strip().splitlines()[0][:200] if failures else type(err).__name__
    try:
        reason += f", {shutil.disk_usage(tmp.parent).free / 2**20:.1f} MiB free"
    except OSError:
        pass
    return f"checkpoint {tmp}: cannot write ({reason}); free some space or choose another --checkpoint-dir."


def _publish(directory: Path, tmp: Path, final: Path, meta: dict[str, Any], keep: int) -> None:
    """Rank 0: write medley.json, rename ``tmp`` to ``final`` and delete all but the ``keep``
    newest checkpoints. Renames
    move links themselves and removals remove them as links: nothing outside is touched."""
    with os.fdopen(open_no_follow(tmp / META_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL), "w") as handle:
        json.dump(meta, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    old = directory / f".old-{final.name}"
    if os.path.lexists(final):  # the same step saved again after a restart: replaced once the new is whole
        remove_path(old)
        os.rename(final, old)
    os.rename(tmp, final)
    remove_path(old)
    for previous in step_directories(directory)[:-keep]:
        doomed = directory / f".old-{previous.name}"
        remove_path(doomed)
        os.rename(previous, doomed)  # out of sight at once: a half-deleted step-N would look damaged
        remove_path(doomed)


@dataclass(kw_only=True)
class _Pending:
    """An asynchronous save in flight: DCP writes in a thread; published by :meth:`CheckpointStore.finish`."""

    tmp: Path
    final: Path
    meta: dict[str, Any]
    future: Any


@dataclass(kw_only=True)
class CheckpointStore:
    """One run's checkpoints in ``directory``: collective saves, and the asynchronous one in flight
    until it is published. One store per process group (its asynchronous saves run over a gloo
    group of its own, made at the first of them).

    Attributes:
        directory: the checkpoint directory (``--checkpoint-dir``).
        keep: how many of the newest checkpoints a save keeps (``--keep``).
    """

    directory: Path
    keep: int = KEEP
    _pending: _Pending | None = field(default=None, init=False, repr=False)
    _group: dist.ProcessGroup | None = field(default=None, init=False, repr=False)

    @classmethod
    def of(cls, settings: CheckpointConfig) -> CheckpointStore | None:
        """The store of a run's ``[checkpoint]`` settings; None when the run saves nothing."""
        return None if settings.dir is None else cls(directory=Path(settings.dir), keep=settings.keep)

    def finish(self) -> Path | None:
        """Collective: wait for the asynchronous save in flight, if any, and publish it (as
        :meth:`save` does a synchronous one); its path, or None when none was."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        written, hashes, error = None, {}, None
        try:
            written = pending.future.result()
            hashes = _hash_files(pending.tmp, _checkpoint_files(pending.tmp))
        except (Exception, CheckpointException) as err:
            error = _write_failure(pending.tmp, err)
        return _publish_all(self.directory, pending.tmp, pending.final, pending.meta, self.keep,
                            written=written, hashes=hashes, error=error)

    def drop(self) -> None:
        """Forget a save in flight without publishing it (the run failed: it stays a temporary),
        and the saves' process group (the run's is about to go)."""
        self._pending, self._group = None, None

    def save(self, *, next_step: int, stages: dict[int, ShardedStage], meta: dict[str, Any],
             train_state: dict[str, torch.Tensor] | None = None, asynchronous: bool = False) -> Path:
        """Collective: every rank writes its shards; rank 0 publishes the directory atomically and
        keeps the ``keep`` newest checkpoints.

        Nothing is written when a tensor is not finite; a failed write (disk full) removes the
        temporary directory, keeps the previous checkpoints and is one :class:`MedleyInputError` on
        every rank. ``asynchronous``: the state is copied to host memory and written by DCP's
        ``async_save`` in a thread, over the store's process group, while training goes on; the
        checkpoint is published by :meth:`finish` (the next save calls it), and until then it is a
        temporary directory that no resume reads."""
        self.finish()
        directory = Path(self.directory)
        final = checkpoint_path(directory, next_step)
        tmp = directory / f"{TEMP_PREFIX}{final.name}"
        state = checkpoint_state(stages, for_load=False)
        state["train.next_step"].fill_(next_step)
        state.update({f"train.{name}": value for name, value in (train_state or {}).items()})
        bad = shared_error(_non_finite(state))
        if bad is not None:
            raise MedleyInputError(
                f"step {next_step - 1}: {bad} holds non-finite values, so no checkpoint is written (the "
                f"newest good one in {directory} is kept); lower --lr or --clip-norm and resume")
        error = None
        if dist.get_rank() == 0:
            try:
                for leftover in [tmp, *directory.glob(".old-*")]:  # a save or rotation cut short earlier
                    remove_path(leftover)
                tmp.mkdir(parents=True)
            except OSError as err:
                error = "checkpoint " + os_error_message(tmp, err)
        _raise_if(shared_error(error))
        full_meta = {**meta, "format": FORMAT, "next_step": next_step}
        if asynchronous:
            if self._group is None:
                self._group = dist.new_group(backend="gloo")
            future = dcp.async_save(state, storage_writer=FileSystemWriter(tmp, thread_count=1),
                                    process_group=self._group)
            self._pending = _Pending(tmp=tmp, final=final, meta=full_meta, future=future)
            return final
        written, hashes = None, {}
        try:
            written = dcp.save(state, storage_writer=FileSystemWriter(tmp, thread_count=1))
            hashes = _hash_files(tmp, _checkpoint_files(tmp))
        except (Exception, CheckpointException) as err:  # DCP gathers every rank's failure
            error = _write_failure(tmp, err)
        return _publish_all(directory, tmp, final, full_meta, self.keep, written=written, hashes=hashes,
                            error=error)


def _publish_all(directory: Path, tmp: Path, final: Path, meta: dict[str, Any], keep: int, *,
                 written: Any, hashes: dict[str, str], error: str | None) -> Path:
    """Collective, after every rank wrote its shards (or failed to: ``error``): rank 0 publishes."""
    _raise_if(shared_error(error), cleanup=tmp)
    if dist.get_rank() == 0:
        try:
            _publish(directory, tmp, final, {**meta, "entries": manifest_of(written), "files": hashes}, keep)
        except OSError as err:
            error = "checkpoint " + os_error_message(tmp, err)
    _raise_if(shared_error(error), cleanup=tmp)
    return final


def _raise_if(error: str | None, *, cleanup: Path | None = None) -> None:
    if error is None:
        return
    if cleanup is not None and dist.get_rank() == 0:
        remove_path(cleanup)
    raise MedleyInputError(error)


# Settings that fix what the checkpoint's tensors mean: a resume with another value is refused.
_FIXED = {"model": "--model / the plan's [model]", "optimizer": "--optimizer",
          "seq_len": "--seq-len / layout.seq_len", "adapter": "--lora-* / the plan's adapter"}
# Settings that fix which data each step sees: another value is refused unless the data order is reset.
DATA_ORDER = {"seed": "--seed", "global_batch": "the global batch (micro-batches x micro-batch size)",
              "data": "--data"}


def _schedule_text(recorded: Any) -> str:
    try:
        return LrSchedule(**recorded).describe()
    except TypeError:  # a medley.json this medley did not write
        return repr(recorded)


def check_meta(path: Path, saved: dict[str, Any], expected: dict[str, Any], *,
               reset_data_order: bool = False, extend_schedule: bool = False) -> list[str]:
    """Refuse a resume that changes the model, optimizer or sequence length; one that changes the
    data order (seed, global batch, data) unless ``reset_data_order``, or the learning-rate
    schedule unless ``extend_schedule`` (a checkpoint without one, from an older medley, is not
    checked). Returns the accepted changes, each named with the flag that accepted it."""
    for key, setting in _FIXED.items():
        if saved.get(key) != expected.get(key):
            raise MedleyInputError(
                f"checkpoint {path} was written with {key} = {saved.get(key)!r} but this run has "
                f"{expected.get(key)!r}; change {setting} to match, or use another --checkpoint-dir")
    changed = [f"{key} {saved.get(key)!r} -> {expected.get(key)!r}" for key in DATA_ORDER
               if saved.get(key) != expected.get(key)]
    if changed and not reset_data_order:
        settings = ", ".join(DATA_ORDER[key] for key in DATA_ORDER if saved.get(key) != expected.get(key))
        raise MedleyInputError(
            f"checkpoint {path} was written with another data order ({'; '.join(changed)}); change "
            f"{settings} back, or pass --reset-data-order to continue with the new one")
    accepted = [f"a new data order (--reset-data-order): {'; '.join(changed)}"] if changed else []
    old, new = saved.get("schedule"), expected.get("schedule")
    if old is not None and new is not None and old != new:
        before, after = _schedule_text(old), _schedule_text(new)
        if not extend_schedule:
            raise MedleyInputError(
                f"checkpoint {path} follows the learning-rate schedule {before}, this run's is {after}; a "
                "resume continues the checkpoint's curve: give --steps, --lr, --min-lr, --warmup-steps, "
                "--lr-schedule and --decay-fraction as it was written with, or pass --extend-schedule to "
                "follow this run's from the resumed step")
        accepted.append(f"a new schedule (--extend-schedule): {before} -> {after}")
    return accepted


def _expected_entries(state: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """Collective: the entries (kind, dtype, global shape) the tensors of every rank's ``state``
    load from, keyed as saved."""
    gathered: list[dict[str, dict[str, Any]] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {key: entry_of(value) for key, value in state.items()})
    return {key: entry for part in gathered for key, entry in (part or {}).items()}


def load_checkpoint(path: Path, *, stages: dict[int, ShardedStage], expected: dict[str, Any],
                    reset_data_order: bool = False, extend_schedule: bool = False,
                    train_state: dict[str, torch.Tensor] | None = None) -> tuple[int, list[str]]:
    """Collective: fill this rank's stages and optimizers from ``path``, and in place those
    ``train_state`` tensors the checkpoint has; returns the next step and the changes accepted
    (:func:`check_meta`: a data order with ``reset_data_order``, a schedule with
    ``extend_schedule``). Before any tensor is read: medley.json,
    the file hashes, the ``.metadata`` and its entries against those of this run (every rank's
    model, optimizer and ``train_state``), each refusal one :class:`MedleyInputError`."""
    fix = resume_fix(path)
    saved = read_meta(path, fix=fix)
    changed = check_meta(path, saved, expected, reset_data_order=reset_data_order,
                         extend_schedule=extend_schedule)
    metadata = verified_metadata(Path(path), saved, fix=fix, hashes=_hash_files)
    tied = any(stage.module.spec.tied_embeddings for stage in stages.values())  # the same on every rank
    state = checkpoint_state(stages, for_load=True)
    copies = checkpoint_state(stages, for_load=True, copies=True) if tied else {}
    extra = {f"train.{name}": value for name, value in (train_state or {}).items()}
    check_entries(path, saved["entries"], _expected_entries({**state, **copies, **extra}),
                  optional=set(extra), what="this run", fix=fix)
    state.update({key: value for key, value in extra.items() if key in saved["entries"]})
    # Every rank loads both parts: collective.
    load_tensors([state, copies] if tied else [state], Path(path), metadata, what="this model", fix=fix)
    for stage in stages.values():
        stage.refresh_gathered()
    torch.set_rng_state(state["train.rng"])
    return int(state["train.next_step"]), changed

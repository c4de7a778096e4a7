"""The GPU check (``scripts/gpu-check.sh``): what medley predicts and measures on this machine's
CUDA GPUs, in at most ten minutes, as JSON + Markdown under bench/results/.

1. Every GPU's name matched to the device catalog (``medley.spec.catalog.device_type_for_cuda``).
2. ``medley profile --device cuda`` of a ~1B LLaMA-shaped model (TinyLlama's shape), bf16 and fp16.
3. Training steps through medley's own path (``medley simulate`` and ``medley train`` of the same
   inline plan, the fresh profile giving the prediction): bf16 and fp16 on one GPU; with two or
   more, a pp 2 and a tp 2 plan too. Predicted against measured step time (mean of the steps after
   the first two) and peak memory (``torch.cuda.max_memory_allocated``, per device).
4. A plain torch FSDP2 training loop of the same model, written here (torchtitan-style:
   ``fully_shard`` per block and the root, bf16 parameters with fp32 reductions, fused AdamW), on
   every GPU: its MFU next to medley's.

``--device cpu`` (or ``--dry-run``) runs every step the same way on CPU ranks (gloo) with the tiny
model and two steps, so that the code is exercised without a GPU (tests/bench/test_gpu_check.py);
its figures say nothing about a GPU. Each step is recorded with its error, if any, and the report
is written whatever failed. A step that would start past the time budget is skipped and says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from provenance import ROOT, provenance  # noqa: E402

# TinyLlama-1.1B's shape (a Hugging Face config.json, as `--model FILE` reads it).
ONE_B_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048,
    "intermediate_size": 5632, "num_attention_heads": 32, "num_hidden_layers": 22, "num_key_value_heads": 4,
    "vocab_size": 32000, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "hidden_act": "silu",
}
LAYER_FIGURES = ("kind", "micro_batch_size", "seq_len", "forward_s", "backward_full_s")
CLI = "import sys; from medley.cli.main import app; sys.argv[0] = 'medley'; app()"


def medley(args: list[str], *, timeout: float) -> str:
    """Run ``medley ARGS`` with this Python; its stdout, or RuntimeError with the tail of stderr."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", CLI, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-6:]
        raise RuntimeError(f"medley {' '.join(args[:1])} exit {done.returncode}: " + " | ".join(tail))
    return done.stdout


class Budget:
    """Seconds left of the check; a step that needs more is skipped."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def step(report: dict, name: str, budget: Budget, need_s: float, fn: Any, *args: Any) -> Any:
    """Run one step, recording its seconds and error; None when it failed or was skipped."""
    entry: dict[str, Any] = {"step": name}
    report["steps"].append(entry)
    if budget.left() < need_s:
        entry["skipped"] = f"{budget.left():.0f} s left of the budget, {need_s:.0f} s needed"
        return None
    started = time.monotonic()
    try:
        result = fn(*args, timeout=max(10.0, budget.left()))
        entry["ok"] = True
        return result
    except Exception as err:  # noqa: BLE001 - recorded, the other steps still run
        entry["ok"] = False
        entry["error"] = f"{type(err).__name__}: {err}"[:2000]
        if os.environ.get("MEDLEY_DEBUG"):
            traceback.print_exc()
        return None
    finally:
        entry["seconds"] = round(time.monotonic() - started, 1)


def devices(device: str, ranks: int) -> dict:
    """The GPUs and their catalog entries (CPU: the CPU-8GB entry, what a CPU profile is labelled)."""
    import torch

    from medley.errors import MedleyInputError
    from medley.spec.catalog import cuda_mismatch, device_type_for_cuda, get_device_type

    if device == "cpu":
        entry = get_device_type("CPU-8GB")
        return {"kind": "cpu", "count": ranks, "gpus": [], "catalog": entry.name, "torch": torch.__version__}
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        row: dict[str, Any] = {"index": index, "name": props.name, "memory_bytes": props.total_memory}
        try:
            entry = device_type_for_cuda(props.name)
            row["catalog"] = entry.name
            row["mismatch"] = cuda_mismatch(entry, props.name, props.total_memory)
        except MedleyInputError as err:
            row["catalog"], row["error"] = None, str(err)
        gpus.append(row)
    types = {g["catalog"] for g in gpus}
    return {"kind": "cuda", "count": len(gpus), "gpus": gpus, "torch": torch.__version__,
            "cuda": torch.version.cuda, "catalog": gpus[0]["catalog"] if gpus else None,
            "mixed": len(types) > 1}


def profile(model: str, *, device: str, device_type: str, dtype: str, shape: dict, out: Path,
            timeout: float) -> dict:
    args = ["profile", "--model", model, "--device", device, "--device-type", device_type, "--dtype", dtype,
            "--micro-batch-sizes", str(shape["mbs"]), "--seq-len", str(shape["seq"]),
            "--runs", str(shape["runs"]),
            "--comm-ranks", "0", "--no-overhead", "--out", str(out), "--json"]
    data = json.loads(medley(args, timeout=timeout))
    return {"file": out.name, "device_type": data["device_type"], "detail": data["device_detail"],
            "layers": [{k: m[k] for k in LAYER_FIGURES} for m in data["layers"]]}


def plan_flags(case: dict, *, model: str, device_type: str, shape: dict, blocks: int) -> list[str]:
    """The inline plan both ``medley simulate`` and ``medley train`` take."""
    pp, tp = case["pp"], case["tp"]
    half = blocks // pp
    split = ",".join(str(half + (1 if k < blocks - half * pp else 0)) for k in range(pp))
    return ["--model", model, "--cluster", f"{pp * tp}x{device_type}", "--pp", str(pp), "--dp", "1",
            "--tp", str(tp), "--schedule", "1f1b", "--micro-batches", str(shape["micro_batches"]),
            "--micro-batch-size", str(shape["mbs"]), "--seq-len", str(shape["seq"]), "--split", split,
            "--zero", ",".join(["0"] * pp), "--dtype", case["dtype"]]


def simulate(flags: list[str], profile_file: Path, *, timeout: float) -> dict:
    data = json.loads(medley(["simulate", *flags, "--profile", str(profile_file), "--json"], timeout=timeout))
    return {"step_time_s": data["step_time_s"], "mfu": data["mfu"], "fits": data["fits"],
            "peak_memory_bytes": {str(d["device"]): d["peak_memory_gb"] * 1e9 for d in data["devices"]},
            "cost_sources": data.get("cost_sources")}


def train(flags: list[str], *, ranks: int, steps: int, timeout: float) -> dict:
    args = ["train", *flags, "--local-ranks", str(ranks), "--steps", str(steps), "--data", "synthetic",
            "--warmup-steps", "1", "--json"]
    records = json.loads(medley(args, timeout=timeout))["records"]
    timed = records[2:] or records[1:] or records
    return {"steps": len(records), "timed_steps": len(timed),
            "step_time_s": sum(r["step_time_s"] for r in timed) / len(timed),
            "first_step_s": records[0]["step_time_s"], "mfu": timed[-1]["mfu"],
            "peak_memory_bytes": records[-1]["peak_memory_bytes"], "losses": [r["loss"] for r in records]}


def reference_worker(rank: int, world: int, port: int, model: str, shape: dict, steps: int, out: str) -> None:
    """One rank of the plain FSDP2 loop (torchtitan-style), bf16 parameters, fp32 reductions."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from medley.runtime.model import Decoder, token_loss_sum
    from medley.spec.model_arg import get_model

    cuda = torch.cuda.is_available() and shape["device"] == "cuda"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    spec = get_model(model)
    with torch.device("meta"):
        net = Decoder(spec, init=False)
    mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in net.blocks.values():
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(net, mesh=mesh, mp_policy=policy)
    net.to_empty(device=device)
    with torch.no_grad():
        for name, param in net.named_parameters():
            param.fill_(1.0) if "norm" in name else param.normal_(0.0, 0.02)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1,
                                  **({"fused": True} if cuda else {"foreach": True}))
    gen = torch.Generator().manual_seed(rank)
    times = []
    for index in range(steps):
        if index == min(2, steps - 1) and cuda:
            torch.cuda.reset_peak_memory_stats(device)
        if cuda:
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        for _ in range(shape["micro_batches"]):
            tokens = torch.randint(0, spec.vocab_size, (shape["mbs"], shape["seq"] + 1), generator=gen)
            tokens = tokens.to(device)
            loss = token_loss_sum(net(tokens[:, :-1]), tokens[:, 1:]) / tokens[:, 1:].numel()
            loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, {"times": times, "peak": peak})
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    dist.destroy_process_group()
    # The interpreter's own teardown then aborted a CPU rank now and then ("terminate called without
    # an active exception", SIGABRT: a native thread still joinable at exit); its work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def reference(model: str, *, shape: dict, ranks: int, steps: int, device_type: str, timeout: float) -> dict:
    import socket as sock

    import torch.multiprocessing as mp

    from medley.cost.formulas import megatron_flops_per_step
    from medley.spec.catalog import get_device_type
    from medley.spec.model_arg import get_model

    with sock.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "reference.json"
        mp.start_processes(reference_worker, args=(ranks, port, model, shape, steps, str(out)), nprocs=ranks,
                           join=True, start_method="spawn")
        ranks_out = json.loads(out.read_text())
    per_step = [max(r["times"][i] for r in ranks_out) for i in range(steps)]
    timed = per_step[2:] or per_step[1:] or per_step
    step_s = sum(timed) / len(timed)
    spec = get_model(model)
    flops = megatron_flops_per_step(spec, batch_size=shape["mbs"] * shape["micro_batches"] * ranks,
                                    seq_len=shape["seq"])
    peak = get_device_type(device_type).peak_flops("bf16") * ranks
    return {"ranks": ranks, "dtype": "bf16", "step_time_s": step_s, "mfu": flops / step_s / peak,
            "peak_memory_bytes": {str(i): r["peak"] for i, r in enumerate(ranks_out)}}


def cases(count: int) -> list[dict]:
    rows = [{"name": "1gpu-bf16", "pp": 1, "tp": 1, "dtype": "bf16"},
            {"name": "1gpu-fp16", "pp": 1, "tp": 1, "dtype": "fp16"}]
    if count >= 2:
        rows += [{"name": "pp2-bf16", "pp": 2, "tp": 1, "dtype": "bf16"},
                 {"name": "pp2-fp16", "pp": 2, "tp": 1, "dtype": "fp16"},
                 {"name": "tp2-bf16", "pp": 1, "tp": 2, "dtype": "bf16"}]
    return rows


def ratio(predicted: float | None, measured: float | None) -> float | None:
    if not predicted or not measured:
        return None
    return predicted / measured - 1.0


def compare(case: dict, predicted: dict | None, measured: dict | None) -> dict:
    row: dict[str, Any] = {**case, "predicted": predicted, "measured": measured}
    if predicted and measured:
        row["step_time_error"] = ratio(predicted["step_time_s"], measured["step_time_s"])
        row["memory_error"] = {d: ratio(predicted["peak_memory_bytes"].get(d), b)
                               for d, b in measured["peak_memory_bytes"].items()}
    return row


def run(args: argparse.Namespace) -> dict:
    dry = args.device == "cpu"
    budget = Budget(args.budget_s)
    report: dict[str, Any] = {"created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                              "host": socket.gethostname(), "provenance": provenance(), "device": args.device,
                              "steps": [], "runs": [], "profiles": {}, "reference": None}
    found = step(report, "devices", budget, 5, lambda timeout: devices(args.device, args.ranks))
    report["devices"] = found
    if found is None or not found["count"] or not found["catalog"]:
        report["verdict"] = "no usable device (see steps)"
        return report
    count = min(found["count"], args.ranks or found["count"])
    device_type = found["catalog"]
    work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    if dry:
        model, blocks = "tiny", 4
        shape = {"mbs": 2, "seq": 32, "micro_batches": 2, "runs": 1, "device": "cpu"}
    else:
        model, blocks = str(work / "config.json"), ONE_B_CONFIG["num_hidden_layers"]
        (work / "config.json").write_text(json.dumps(ONE_B_CONFIG))
        shape = {"mbs": 2, "seq": 1024, "micro_batches": 4, "runs": 3, "device": "cuda"}
    report["model"] = "tiny" if dry else {"config": ONE_B_CONFIG, "name": "TinyLlama-1.1B shape"}
    report["shape"] = shape
    for dtype in ("bf16", "fp16"):
        out = work / f"profile-{dtype}.json"
        got = step(report, f"profile {dtype}", budget, 60 if not dry else 5,
                   lambda timeout, d=dtype, o=out: profile(model, device=args.device, device_type=device_type,
                                                           dtype=d, shape=shape, out=o, timeout=timeout))
        report["profiles"][dtype] = got
    for case in cases(count):
        world = case["pp"] * case["tp"]
        flags = plan_flags(case, model=model, device_type=device_type, shape=shape, blocks=blocks)
        profile_file = work / f"profile-{case['dtype']}.json"
        predicted = None
        if profile_file.exists():
            predicted = step(report, f"simulate {case['name']}", budget, 5,
                             lambda timeout, f=flags, p=profile_file: simulate(f, p, timeout=timeout))
        measured = step(report, f"train {case['name']}", budget, 60 if not dry else 10,
                        lambda timeout, f=flags, w=world: train(f, ranks=w, steps=args.steps,
                                                                  timeout=timeout))
        report["runs"].append(compare(case, predicted, measured))
    report["reference"] = step(report, "reference FSDP2 loop", budget, 60 if not dry else 10,
                               lambda timeout: reference(model, shape=shape, ranks=count, steps=args.steps,
                                                         device_type=device_type, timeout=timeout))
    failed = [s["step"] for s in report["steps"] if s.get("ok") is False or "skipped" in s]
    report["verdict"] = "every step ran" if not failed else f"failed or skipped: {', '.join(failed)}"
    return report


def fmt(value: float | None, scale: float = 1.0, unit: str = "", digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}{unit}"


def markdown(report: dict) -> str:
    found = report.get("devices") or {}
    lines = [f"# GPU check ({report['device']})", "",
             f"{report['created']} on {report['host']}; commit {report['provenance']['commit']}; "
             f"command `{report['provenance']['command']}`; torch {found.get('torch')}.", "",
             f"Verdict: {report['verdict']}.", ""]
    if report["device"] == "cpu":
        lines += ["A dry run on CPU ranks with the tiny model: it exercises the script, its figures say "
                  "nothing about a GPU.", ""]
    if found.get("gpus"):
        lines += ["| GPU | name | memory GiB | catalog | mismatch |", "| --- | --- | --- | --- | --- |"]
        lines += [f"| {g['index']} | {g['name']} | {g['memory_bytes'] / 2**30:.0f} | "
                  f"{g.get('catalog') or '-'} | "
                  f"{g.get('mismatch') or g.get('error') or '-'} |" for g in found["gpus"]]
        lines.append("")
    lines += ["| run | predicted ms | measured ms | error | predicted peak MiB | measured peak MiB | MFU |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in report["runs"]:
        p, m = row["predicted"] or {}, row["measured"] or {}
        pmem = max((p.get("peak_memory_bytes") or {}).values(), default=None)
        mmem = max((m.get("peak_memory_bytes") or {}).values(), default=None)
        lines.append(f"| {row['name']} | {fmt(p.get('step_time_s'), 1e3)} | "
                     f"{fmt(m.get('step_time_s'), 1e3)} | "
                     f"{fmt(row.get('step_time_error'), 100, '%')} | {fmt(pmem, 2**-20)} | "
                     f"{fmt(mmem, 2**-20)} | {fmt(m.get('mfu'), 100, '%')} |")
    ref = report.get("reference")
    if ref:
        rmem = max((v for v in ref["peak_memory_bytes"].values() if v is not None), default=None)
        lines.append(f"| plain FSDP2 loop, {ref['ranks']} rank(s), bf16 | - | "
                     f"{fmt(ref['step_time_s'], 1e3)} | - | - "
                     f"| {fmt(rmem, 2**-20)} | {fmt(ref['mfu'], 100, '%')} |")
    lines += ["", "| step | seconds | result |", "| --- | --- | --- |"]
    for s in report["steps"]:
        result = s.get("skipped") or ("ok" if s.get("ok") else s.get("error", ""))
        lines.append(f"| {s['step']} | {s.get('seconds', '-')} | {str(result).replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dry-run", action="store_true", help="the same steps on CPU ranks (= --device cpu)")
    parser.add_argument("--ranks", type=int, default=0,
                        help="GPUs to use (default: all); CPU ranks with --device cpu")
    parser.add_argument("--steps", type=int, default=0,
                        help="training steps per run (default: 8 on CUDA, 3 on CPU)")
    parser.add_argument("--budget-s", type=float, default=570.0, help="stop starting steps after this")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.device = "cpu"
    if args.device == "cpu":
        args.ranks = args.ranks or 1
    args.steps = args.steps or (3 if args.device == "cpu" else 8)
    report = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "gpu-check" if args.device == "cuda" else "gpu-check-dry-run"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {args.out / stem}.json and .md")
    return 0 if report["verdict"] == "every step ran" else 1


if __name__ == "__main__":
    sys.exit(main())

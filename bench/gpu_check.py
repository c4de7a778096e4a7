"""The GPU check (``scripts/gpu-check.sh``): in one call of at most six minutes on a one-GPU
machine, what medley plans, predicts and measures there, next to a plain PyTorch loop of the same
arithmetic; one JSON summary and its Markdown under bench/results/ (gpu-check.json / .md).

Steps, in the order they run (each time-boxed; one that would start past the budget is skipped
and says so; every step's outcome and error is recorded and the report is written whatever failed):

1. probe: torch, CUDA, NCCL and the GPUs (bench/gpu_check_plain.py --probe), each matched to the
   catalog (an unknown GPU: H100-SXM-80GB stands in, and the report says so).
2. ``medley plan`` on the catalog for one such GPU, of a ~1B LLaMA (TinyLlama-1.1B's shape) and of
   LLaMA-2-7B, bf16, seq 2048, global batch 8; ``medley show`` of each plan: the catalog's
   prediction of step time and peak memory.
3. a 2-rank plan on one GPU (``CUDA_VISIBLE_DEVICES=0``): what medley does (the issue wants one
   line and exit 2).
4. the plain loop of the 1B plan (bench/gpu_check_plain.py: fp32 master weights, bf16 autocast,
   SDPA, fused AdamW, the plan's micro-batches), eager then compiled; ``medley train`` of the plan.
5. ``medley train`` of the 7B plan; while its ranks initialise (host-side), ``medley profile
   --device cuda`` of both models and ``medley show --profile``: the profile's prediction (a
   profile that overlaps the timed steps is flagged); then the 7B plain loop.
6. ``medley train --compile`` of the 1B plan; the interleaved pp 2, 5 micro-batch case (virtual
   stages 2 and 3) on NCCL against one process's losses when two GPUs are here (else skipped,
   with the reason); ``medley train --compile`` of the 7B plan if time is left.

Tokens/s and MFU of medley and of the plain loop use one formula (Megatron's FLOPs per step over
the catalog's dense bf16 peak), so they compare. The checks (the issue's figures: medley's tokens/s
at least the plain loop's, predicted/measured step time and peak memory within 10%, memory never
under-predicted) are in bench/gpu_check_report.py.

``--dry-run`` (or ``--device cpu``) runs the same steps on CPU ranks (gloo) with the tiny model,
one case, a few steps and the plain loop compiled with ``aot_eager`` (no C++ build), so the code
cannot rot without a GPU (tests/bench/test_gpu_check.py); its figures say nothing about a GPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import socket
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
import gpu_check_medley as cli  # noqa: E402
from gpu_check_report import checks, markdown  # noqa: E402
from provenance import ROOT, provenance  # noqa: E402

sys.path.insert(0, str(ROOT / "src"))
from medley.cost.formulas import megatron_flops_per_step, total_params  # noqa: E402
from medley.spec.catalog import cuda_mismatch, device_type_for_cuda, get_device_type  # noqa: E402
from medley.spec.model_arg import get_model  # noqa: E402

# TinyLlama-1.1B's shape (a Hugging Face config.json, as `--model FILE` reads it).
ONE_B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_attention_heads": 32,
    "num_hidden_layers": 22,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
GPU_CASES = [
    {
        "name": "1b",
        "model": "config:1b",
        "label": "TinyLlama-1.1B shape",
        "global_batch": 8,
        "seq_len": 2048,
        "steps": 8,
    },
    {
        "name": "7b",
        "model": "llama-2-7b",
        "label": "LLaMA-2-7B",
        "global_batch": 8,
        "seq_len": 2048,
        "steps": 6,
    },
]
DRY_CASES = [
    {
        "name": "tiny",
        "model": "tiny",
        "label": "tiny (CPU dry run)",
        "global_batch": 8,
        "seq_len": 64,
        "steps": 4,
    }
]
STAND_IN = "H100-SXM-80GB"
WHEEL_STAMP = ROOT / ".gpu-wheels" / "stamp.json"  # scripts/gpu-wheels.sh: the commit the wheels went with

# (seconds a step needs to be started, the most it may run) on a GPU; a dry run takes (5, 180).
BOXES = {
    "probe": (5, 90),
    "help": (3, 60),
    "plan": (3, 60),
    "show": (3, 60),
    "refusal": (5, 90),
    "plain 1b": (40, 150),
    "plain 7b": (45, 150),
    "train 1b": (30, 150),
    "train 7b": (90, 240),
    "profile": (15, 120),
    "compiled 1b": (50, 150),
    "compiled 7b": (130, 240),
    "interleaved": (20, 90),
}


class Budget:
    """Seconds left of the check; a step that needs more is skipped."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


class Check:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dry = args.device == "cpu"
        self.budget = Budget(args.budget_s)
        self.work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
        self.lock = threading.Lock()
        self.flags: set[str] = set()
        self.report: dict[str, Any] = {
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "host": socket.gethostname(),
            "provenance": stamped_provenance(),
            "device": args.device,
            "budget_s": args.budget_s,
            "steps": [],
            "cases": {},
            "refusal": None,
            "interleaved": None,
        }

    def box(self, key: str) -> tuple[float, float]:
        return (5.0, 180.0) if self.dry else BOXES[key.split(" (")[0]]

    def step(self, name: str, key: str, fn: Any) -> Any:
        """Run ``fn(timeout=...)`` as one step: its seconds and error recorded; None when it failed
        or was skipped."""
        need, cap = self.box(key)
        entry: dict[str, Any] = {"step": name}
        with self.lock:
            self.report["steps"].append(entry)
        if self.budget.left() < need:
            entry["skipped"] = f"{self.budget.left():.0f} s left of the budget, {need:.0f} s needed"
            return None
        entry["started"] = time.time()
        clock = time.monotonic()
        print(f"gpu-check: {name} ...", file=sys.stderr, flush=True)
        try:
            result = fn(timeout=min(cap, self.budget.left()))
            entry["ok"] = True
            return result
        except Exception as err:  # noqa: BLE001 - recorded, the other steps still run
            entry["ok"] = False
            entry["error"] = f"{type(err).__name__}: {err}"[:2000]
            if self.args.debug:
                traceback.print_exc()
            return None
        finally:
            entry["ended"] = time.time()
            entry["seconds"] = round(time.monotonic() - clock, 1)
            print(
                f"gpu-check: {name}: {entry.get('error') or 'ok'} ({entry['seconds']} s)",
                file=sys.stderr,
                flush=True,
            )

    def skip(self, name: str, reason: str) -> None:
        self.report["steps"].append({"step": name, "skipped": reason, "by_design": True})

    # -- the steps -----------------------------------------------------------------------------

    def probe(self, *, timeout: float) -> dict:
        out = self.work / "probe.json"
        done = cli.spawn(
            [sys.executable, str(ROOT / "bench" / "gpu_check_plain.py"), "--probe", str(out)], timeout=timeout
        )
        if done.rc != 0:
            raise RuntimeError(f"probe exit {done.rc}: {done.tail()}")
        found = json.loads(out.read_text())
        for gpu in found["gpus"]:
            try:
                entry = device_type_for_cuda(gpu["name"])
                gpu["catalog"], gpu["mismatch"] = (
                    entry.name,
                    cuda_mismatch(entry, gpu["name"], gpu["memory_bytes"]),
                )
            except Exception as err:  # noqa: BLE001 - an unknown GPU: recorded, a stand-in is used
                gpu["catalog"], gpu["error"] = None, str(err)
        if self.dry:
            found["catalog"], found["count"] = "CPU-8GB", 2
        else:
            found["count"] = len(found["gpus"])
            first = found["gpus"][0]["catalog"] if found["gpus"] else None
            found["catalog"] = first or STAND_IN
            if found["gpus"] and not first:
                found["stand_in"] = f"{found['gpus'][0]['name']} is not in the catalog: {STAND_IN} stands in"
        return found

    def model_arg(self, case: dict) -> str:
        if case["model"] == "config:1b":
            path = self.work / "tinyllama-1b" / "config.json"
            path.parent.mkdir(exist_ok=True)
            path.write_text(json.dumps(ONE_B_CONFIG))
            return str(path)
        return case["model"]

    def plain_spec(self, case: dict, state: dict, *, timeout: float) -> dict:
        spec, plan = state["spec"], state["plan"]
        if (spec.mlp, spec.norm, spec.position, spec.bias, spec.sliding_window) != (
            "swiglu",
            "rmsnorm",
            "rope",
            False,
            None,
        ):
            raise RuntimeError(f"the plain loop is a LLaMA; {spec.name} is not one")
        if plan["pp"] != 1 or plan["dp"] != 1 or plan["tp"] not in ([1], 1):
            raise RuntimeError(
                f"the plain loop runs one device; the plan has pp {plan['pp']}, dp {plan['dp']}, "
                f"tp {plan['tp']}"
            )
        modes = plan.get("recompute_mode") or ["none"]
        return {
            "model": {
                "hidden_size": spec.hidden_size,
                "num_heads": spec.num_heads,
                "num_kv_heads": spec.num_kv_heads,
                "head_dim": spec.head_dim,
                "ffn_hidden_size": spec.ffn_hidden_size,
                "vocab_size": spec.vocab_size,
                "num_blocks": spec.num_blocks,
                "norm_eps": spec.norm_eps,
                "rope_theta": spec.rope_theta,
                "tied_embeddings": spec.tied_embeddings,
            },
            "micro_batch_size": plan["micro_batch_size"],
            "micro_batches": plan["micro_batches"][0],
            "seq_len": case["seq_len"],
            "recompute": modes[0] != "none",
            "recompute_mode": modes[0],
            "steps": max(1, case["steps"] - 2),
            "warmup": 2,
            "device": self.args.device,
            "compile_backend": "aot_eager" if self.dry else "inductor",
            "compile_estimate_s": 10.0 if self.dry else 60.0,
            "deadline": time.time() + timeout - 10,
            "tokens_per_step": state["tokens_per_step"],
            "flops_per_step": state["flops_per_step"],
            "peak_flops": state["peak_flops"],
        }

    def plain(self, case: dict, state: dict, *, timeout: float) -> dict:
        spec_file, out = (
            self.work / f"plain-{case['name']}-spec.json",
            self.work / f"plain-{case['name']}.json",
        )
        spec_file.write_text(json.dumps(self.plain_spec(case, state, timeout=timeout)))
        error = None
        try:
            done = cli.spawn(
                [sys.executable, str(ROOT / "bench" / "gpu_check_plain.py"), str(spec_file), str(out)],
                timeout=timeout,
            )
            if done.rc != 0:
                error = f"exit {done.rc}: {done.tail()}"
        except cli.MedleyFailed as err:
            error = str(err)
        result = json.loads(out.read_text()) if out.exists() else {"phases": {}, "skipped": {}}
        result.pop("spec", None)
        if error and not result["phases"]:
            raise RuntimeError(f"plain loop {error}")
        if error:
            result["error"] = error  # what it measured before it stopped is kept
        return result

    def train_args(self, state: dict) -> list[str]:
        args = ["--plan", str(state["plan_file"]), "--local-ranks", "1"]
        return args + (["--dtype", state["plan"]["dtype"] or "bf16"] if self.dry else [])

    def train(self, state: dict, *, compile: bool, timeout: float) -> dict:
        return cli.train(
            self.train_args(state),
            steps=state["case"]["steps"],
            compile=compile,
            dry=self.dry,
            flags=self.flags,
            tokens_per_step=state["tokens_per_step"],
            flops_per_step=state["flops_per_step"],
            peak_flops=state["peak_flops"],
            timeout=timeout,
        )

    def profile(self, state: dict, *, timeout: float) -> dict:
        out = self.work / f"profile-{state['case']['name']}.json"
        got = cli.profile(
            state["model_arg"],
            device=self.args.device,
            device_type=self.device_type,
            micro_batch_size=state["plan"]["micro_batch_size"],
            seq_len=state["case"]["seq_len"],
            runs=1 if self.dry else 3,
            out=out,
            timeout=timeout,
        )
        state["profile_file"] = out
        return got

    def profiles(self, states: list[dict]) -> None:
        for state in states:
            name = state["case"]["name"]
            state["result"]["profile"] = self.step(
                f"profile {name} (medley profile --device {self.args.device})",
                "profile",
                lambda timeout, s=state: self.profile(s, timeout=timeout),
            )
            if state.get("profile_file"):
                state["result"]["predicted"]["profile"] = self.step(
                    f"simulate {name} (profile)",
                    "show",
                    lambda timeout, s=state: cli.show(
                        s["plan_file"], profile=s["profile_file"], timeout=timeout
                    ),
                )

    def interleaved(self, *, timeout: float, virtual: int, device_type: str, env: dict | None) -> dict:
        common = [
            "--model",
            "tiny",
            "--micro-batches",
            "5",
            "--micro-batch-size",
            "2",
            "--seq-len",
            "64",
            "--dtype",
            "fp32",
        ]
        spec = get_model("tiny")
        kwargs = dict(
            steps=4,
            tokens_per_step=10 * 64,
            flops_per_step=megatron_flops_per_step(spec, batch_size=10, seq_len=64),
            peak_flops=get_device_type(device_type).peak_flops("fp32"),
            flags=self.flags,
            dry=self.dry,
            env=env,
        )
        started = time.monotonic()
        ranks = cli.train(
            [
                *common,
                "--cluster",
                f"2x{device_type}",
                "--pp",
                "2",
                "--schedule",
                "interleaved",
                "--virtual-stages",
                str(virtual),
                "--local-ranks",
                "2",
            ],
            timeout=timeout,
            **kwargs,
        )
        single = cli.train(
            [*common, "--cluster", f"1x{device_type}", "--pp", "1", "--local-ranks", "1"],
            timeout=max(1.0, timeout - (time.monotonic() - started)),
            **kwargs,
        )
        return {
            "virtual_stages": virtual,
            "backend": "gloo" if self.dry else "nccl",
            **cli.compare_losses(ranks["losses"], single["losses"]),
        }

    # -- the order -----------------------------------------------------------------------------

    def run(self) -> dict:
        report = self.report
        found = self.step("probe", "probe", self.probe)
        report["devices"] = found
        if found is None or (not self.dry and not found["count"]):
            report["verdict"] = "no CUDA device (see steps)" if found else "the probe failed (see steps)"
            return report
        self.device_type = found["catalog"]
        self.flags = (
            self.step("medley train --help", "help", lambda timeout: cli.help_flags("train", timeout=timeout))
            or set()
        )
        report["train_flags_used"] = sorted(self.flags & {"--log-every", "--device"})
        states = [self.prepare(case) for case in (DRY_CASES if self.dry else GPU_CASES)]
        gpu_type = "H200-SXM-141GB" if self.dry else self.device_type
        report["refusal"] = self.step(
            "2-rank plan on one GPU (CUDA_VISIBLE_DEVICES=0)",
            "refusal",
            lambda timeout: cli.refusal(
                [
                    "--model",
                    "tiny",
                    "--cluster",
                    f"2x{gpu_type}",
                    "--pp",
                    "2",
                    "--micro-batches",
                    "2",
                    "--micro-batch-size",
                    "1",
                    "--seq-len",
                    "32",
                    "--local-ranks",
                    "2",
                ],
                env={"CUDA_VISIBLE_DEVICES": "0"},
                timeout=timeout,
            ),
        )
        first, last = states[0], states[-1]
        ready = [s for s in states if s.get("plan")]
        if first.get("plan"):
            self.run_plain(first)
            if first is not last:
                self.run_train(first, compile=False)
        if last.get("plan"):
            # the profiles run while the last model's ranks initialise on the host
            background = threading.Thread(target=self.profiles, args=(ready,), daemon=True)
            background.start()
            self.run_train(last, compile=False)
            background.join()
            self.flag_overlap(ready, last)
            if last is not first:
                self.run_plain(last)
        elif ready:
            self.profiles(ready)
        if first.get("plan") and (not self.dry or self.args.dry_compile):
            self.run_train(first, compile=True)
        self.run_interleaved()
        if last is not first and last.get("plan"):
            self.run_train(last, compile=True)
        report["checks"] = checks(report)
        failed = [
            s["step"]
            for s in report["steps"]
            if s.get("ok") is False or ("skipped" in s and not s.get("by_design"))
        ]
        report["verdict"] = "every step ran" if not failed else f"failed or skipped: {', '.join(failed)}"
        return report

    def prepare(self, case: dict) -> dict:
        """Plan and catalog prediction of one case; its state for the later steps."""
        name = case["name"]
        model_arg = self.model_arg(case)
        spec = get_model(model_arg)
        dtype_peak = get_device_type(self.device_type).peak_flops("bf16")
        result: dict[str, Any] = {
            "label": case["label"],
            "model": spec.name,
            "parameters": total_params(spec),
            "global_batch": case["global_batch"],
            "seq_len": case["seq_len"],
            "predicted": {},
            "medley": {},
            "plain": None,
            "profile": None,
        }
        self.report["cases"][name] = result
        state = {
            "case": case,
            "model_arg": model_arg,
            "spec": spec,
            "result": result,
            "peak_flops": dtype_peak,
            "tokens_per_step": case["global_batch"] * case["seq_len"],
            "flops_per_step": megatron_flops_per_step(
                spec, batch_size=case["global_batch"], seq_len=case["seq_len"]
            ),
            "plan_file": self.work / f"plan-{name}.toml",
        }
        result["flops_per_step"] = state["flops_per_step"]
        state["plan"] = result["plan"] = self.step(
            f"plan {name} (medley plan, 1x{self.device_type})",
            "plan",
            lambda timeout: cli.plan(
                model_arg,
                cluster=f"1x{self.device_type}",
                global_batch=case["global_batch"],
                seq_len=case["seq_len"],
                out=state["plan_file"],
                timeout=timeout,
            ),
        )
        if state["plan"]:
            result["predicted"]["catalog"] = self.step(
                f"simulate {name} (catalog)",
                "show",
                lambda timeout: cli.show(state["plan_file"], profile=None, timeout=timeout),
            )
        return state

    def run_plain(self, state: dict) -> None:
        name = state["case"]["name"]
        state["result"]["plain"] = self.step(
            f"plain PyTorch loop {name} (eager, compiled)",
            f"plain {name}",
            lambda timeout: self.plain(state["case"], state, timeout=timeout),
        )

    def run_train(self, state: dict, *, compile: bool) -> None:
        name, kind = state["case"]["name"], "compiled" if compile else "eager"
        state["result"]["medley"][kind] = self.step(
            f"medley train {name} ({kind})",
            f"{'compiled' if compile else 'train'} {name}",
            lambda timeout: self.train(state, compile=compile, timeout=timeout),
        )

    def flag_overlap(self, ready: list[dict], last: dict) -> None:
        """A profile step still running when the last train's timed steps began: both suspect."""
        measured = last["result"]["medley"].get("eager")
        if not measured:
            return
        for entry in self.report["steps"]:
            if entry["step"].startswith(("profile ", "simulate ")) and entry.get("ended"):
                overlap = entry["ended"] - measured["first_step_started"]
                if overlap > 0:
                    entry["overlap_s"] = round(overlap, 1)
                    entry["note"] = (
                        f"ran {overlap:.1f} s into medley train {last['case']['name']}'s steps: "
                        "both timings are suspect"
                    )

    def run_interleaved(self) -> None:
        name = "interleaved pp 2, 5 micro-batches, against one process"
        count = self.report["devices"]["count"]
        if not self.dry and count < 2:
            self.skip(
                name, f"{count} GPU here: the NCCL case needs 2 (it runs on a machine with two or more)"
            )
            self.report["interleaved"] = {"skipped": "one GPU"}
            return
        device_type = "CPU-8GB" if self.dry else self.device_type
        env = None if self.dry else {"CUDA_VISIBLE_DEVICES": "0,1"}
        self.report["interleaved"] = [
            self.step(
                f"{name} (virtual stages {v}, {'gloo' if self.dry else 'nccl'})",
                "interleaved",
                lambda timeout, v=v: self.interleaved(
                    timeout=timeout, virtual=v, device_type=device_type, env=env
                ),
            )
            for v in ((2,) if self.dry else (2, 3))
        ]


def stamped_provenance() -> dict:
    """The commit and command; without git (the device machine gets a copy of the working tree
    only), the commit scripts/gpu-wheels.sh stamped beside the wheels before the run."""
    found = provenance()
    if not found["commit"].removesuffix("+dirty") and WHEEL_STAMP.exists():
        stamp = json.loads(WHEEL_STAMP.read_text())
        found["commit"] = stamp["commit"]
        found["commit_from"] = (
            f"{WHEEL_STAMP.relative_to(ROOT)} (written {stamp.get('written')}; no git here)"
        )
        if stamp.get("changed"):
            found["changed"] = stamp["changed"]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dry-run", action="store_true", help="the same steps on CPU ranks (= --device cpu)")
    parser.add_argument(
        "--dry-compile",
        action="store_true",
        help="dry run: also medley train --compile (inductor on CPU: slow)",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="stop starting steps after this (default: 330 on CUDA, 240 dry)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--debug", action="store_true", help="tracebacks of failed steps")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.device = "cpu"
    args.budget_s = args.budget_s or (330.0 if args.device == "cuda" else 240.0)
    report = Check(args).run()
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "gpu-check" if args.device == "cuda" else "gpu-check-dry-run"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {args.out / stem}.json and .md")
    return 0 if report["verdict"] == "every step ran" else 1


if __name__ == "__main__":
    sys.exit(main())

"""The command line predicts what the fidelity bench validates: ``medley simulate --profile`` and the
bench's cost source (a :class:`ProfileCostSource` over the same profile, as
:mod:`medley.fidelity.emulate` builds it) give the same step time for the same plan, measured
overheads included (the command line once dropped the per-action, hand-off and collective
overheads the profile measured: 46.98 against 48.25 ms on a pp 2 case)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from medley.cost.estimator import CatalogCostSource
from medley.cost.profile_format import load_profile, save_profile
from medley.cost.profiles import ProfileCostSource
from medley.lowering.predict import predict
from medley.plan.inline import inline_layout
from medley.spec.catalog import CPU_DEVICE_TYPE
from medley.spec.cluster_load import load_cluster
from medley.spec.model_arg import get_model

PROFILE = Path(__file__).parents[2] / "bench" / "results" / "profile-cpu-tiny.json"
TINY = get_model("tiny")
MEDLEY = [sys.executable, "-m", "medley.cli.main"]


@pytest.mark.parametrize(("pp", "dp", "zero"), [(2, 1, "0"), (1, 2, "3")])
def test_simulate_with_a_profile_predicts_what_the_bench_does(tmp_path: Path, pp: int, dp: int,
                                                             zero: str) -> None:
    measured = load_profile(PROFILE)
    assert measured.overhead is not None
    # Every overhead set, whatever this machine measured last (a measured one may clamp to 0):
    # the case is that the command line forwards each of them.
    overhead = measured.overhead.model_copy(update={"action_s": 3e-4, "p2p_handoff_s": 2e-4,
                                                    "collective_s": 2e-3})
    profile = measured.model_copy(update={"overhead": overhead})
    profile_file = tmp_path / PROFILE.name
    save_profile(profile, profile_file)
    cluster_file = tmp_path / "cpus.toml"
    cluster_file.write_text(f'name = "cpus"\n[[nodes]]\nname = "cpus"\ndevice = "{CPU_DEVICE_TYPE}"\n'
                            f"count = {pp * dp}\n")
    cluster = load_cluster(cluster_file)
    flags = {"pp": pp, "dp": dp, "schedule": "1f1b", "micro_batches": "4", "micro_batch_size": 1,
             "seq_len": 128, "zero": zero, "dtype": "fp32"}
    cost = ProfileCostSource(profile=load_profile(profile_file), name=PROFILE.name, model=TINY,
                             fallback=CatalogCostSource.for_cluster(TINY, cluster, dtype="fp32"),
                             device_scale={CPU_DEVICE_TYPE: 1.0})
    layout = inline_layout(cluster=cluster, model=TINY, cost=cost, **flags)
    bench = predict(layout, cluster, cost=cost)[0].step_time_s
    out = subprocess.run([*MEDLEY, "simulate", "--cluster", str(cluster_file), "--profile", str(profile_file),
                          "--model", "tiny", "--pp", str(pp), "--dp", str(dp), "--schedule", "1f1b",
                          "--micro-batches", "4", "--seq-len", "128", "--zero", zero, "--dtype", "fp32",
                          "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    cli = json.loads(out.stdout)["step_time_s"]
    assert cli == pytest.approx(bench, rel=1e-9, abs=0.0)

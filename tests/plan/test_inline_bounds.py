"""Issue #11 (defects 6 and 7): simulate and plan flags that hung or crashed are one-line errors that
name the flag and the limit, and a refused size is refused before anything big is built."""

from __future__ import annotations

import time

import pytest
from typer.testing import CliRunner

from medley.cli.main import app
from medley.cost.estimator import CatalogCostSource
from medley.errors import MedleyInputError
from medley.plan.inline import inline_layout
from medley.search.planner import search
from medley.spec.cluster_load import parse_cluster_arg
from medley.spec.model_arg import get_model

WIDE = {"COLUMNS": "1000"}


def layout(**flags):
    cluster = parse_cluster_arg("64xA100-80GB")
    model = get_model("llama-2-7b")
    args = {"pp": 1, "dp": 1, "schedule": "1f1b", "micro_batches": "8", "micro_batch_size": 1,
            "seq_len": 2048, **flags}
    return inline_layout(cluster=cluster, model=model, cost=CatalogCostSource.for_cluster(model, cluster),
                         **args)


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        ({"buckets": 0}, ["--buckets 0", "1..1,024"]),
        ({"gather_windows": -1}, ["--gather-windows -1", "0..256"]),
        ({"micro_batches": "1000000"}, ["--micro-batches", "<= 10,000"]),
        ({"micro_batches": "1000000000,8", "dp": 2}, ["--micro-batches", "<= 10,000"]),
        ({"micro_batches": "9" * 30}, ["--micro-batches", "too long"]),
        ({"pp": 8, "micro_batches": "10000"}, ["80,000", "limit is 50,000"]),
        ({"pp": 2, "schedule": "interleaved", "virtual_stages": 10**9}, ["--virtual-stages", "1..1,026"]),
        ({"pp": 10**9}, ["--pp", "1..1,026"]),
        ({"dp": 10**9}, ["--dp", "devices"]),
    ],
)
def test_out_of_range_flags_are_one_line_errors(flags: dict, words: list[str]) -> None:
    start = time.monotonic()
    with pytest.raises(MedleyInputError) as err:
        layout(**flags)
    assert time.monotonic() - start < 5
    assert "\n" not in str(err.value)
    for word in words:
        assert word in str(err.value)


def test_the_limits_themselves_are_accepted() -> None:
    assert layout(micro_batches="10000").micro_batches == (10000,)
    assert layout(zero="3", buckets=1024, gather_windows=256).zero[0].gather_windows == 256


@pytest.mark.parametrize("flag", [["--buckets", "0"], ["--gather-windows", "-1"],
                                  ["--micro-batches", "1000000"]])
def test_simulate_exits_2_without_a_traceback(flag: list[str]) -> None:
    result = CliRunner(env=WIDE).invoke(
        app, ["simulate", "--cluster", "8xA100-80GB", "--model", "llama-2-7b", *flag])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert flag[0] in result.stderr


def test_the_planner_refuses_clusters_it_cannot_search_in_seconds() -> None:
    start = time.monotonic()
    result = CliRunner(env=WIDE).invoke(
        app, ["plan", "--cluster", "100000xA100-80GB", "--model", "llama-2-7b", "--global-batch", "512"])
    assert result.exit_code == 2 and "65,536 devices" in result.stderr
    with pytest.raises(MedleyInputError, match="at most 1,024"):
        search(parse_cluster_arg("65536xA100-80GB"), get_model("llama-2-70b"), global_batch=512, seq_len=2048)
    with pytest.raises(MedleyInputError, match="1..10,000 sequences"):
        search(parse_cluster_arg("8xA100-80GB"), get_model("tiny"), global_batch=1000000, seq_len=128)
    assert time.monotonic() - start < 10

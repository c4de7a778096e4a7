"""The Chrome trace and the Gantt PNG of a simulated step."""

from __future__ import annotations

import json

from sim_doubles import AlphaBetaComm, uniform_problem
from test_zero import zero3_problem

from medley.schedule.generators import generate
from medley.sim import simulate
from medley.sim.gantt import write_gantt
from medley.sim.trace import COMPUTE_TID, write_chrome_trace


def test_chrome_trace_has_a_process_per_device_flows_and_memory(tmp_path):
    problem = uniform_problem(generate("1f1b", pp=3, micro_batches=4), send_bytes=10.0, activation_bytes=2.0,
                              comm=AlphaBetaComm(alpha=0.1, beta=100.0))
    result = simulate(problem)
    events = json.loads(write_chrome_trace(result, tmp_path / "t.json").read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "device 0 (replica 0, rank 0)", 1: "device 1 (replica 0, rank 1)",
                     2: "device 2 (replica 0, rank 2)"}
    threads = {e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert threads == {"compute", "p2p send", "p2p recv", "collectives"}
    compute = [e for e in events if e["ph"] == "X" and e.get("tid") == COMPUTE_TID]
    assert len(compute) == 3 * 4 * 2
    starts = {e["id"]: e for e in events if e["ph"] == "s"}
    finishes = {e["id"]: e for e in events if e["ph"] == "f"}
    assert len(starts) == len(finishes) == len(result.transfers) == 2 * 2 * 4
    for flow_id, start in starts.items():
        assert start["pid"] != finishes[flow_id]["pid"]
    first_send = result.transfers[0]
    assert starts[0]["ts"] == first_send[2] * 1e6
    counters = [e for e in events if e["ph"] == "C" and e["pid"] == 0]
    assert max(e["args"]["GiB"] for e in counters) * (1 << 30) == result.device(0).peak_memory_bytes


def test_chrome_trace_puts_collectives_on_every_member(tmp_path):
    result = simulate(zero3_problem())
    events = json.loads(write_chrome_trace(result, tmp_path / "z.json").read_text())["traceEvents"]
    collectives = [(e["pid"], e["name"]) for e in events if e.get("cat") == "collective"]
    assert sorted(collectives) == [(0, "0REDUCE_GRAD"), (0, "0UNSHARD"), (1, "0REDUCE_GRAD"), (1, "0UNSHARD")]


def test_gantt_png_for_sixteen_stages(tmp_path):
    result = simulate(uniform_problem(generate("zb-h1", pp=16, micro_batches=32), f=1, b=1, w=1))
    path = write_gantt(result, tmp_path / "g.png", title="zb-h1")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width >= 1400 and height >= 16 * 50  # a readable row per device

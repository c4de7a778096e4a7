"""The fidelity harness: how far the simulator's predictions are from medley's own runs.

Each case (:mod:`medley.fidelity.cases`) is a plan on an emulated heterogeneous cluster of this
machine's CPU (:mod:`medley.fidelity.emulate`). Its plan is predicted from a measured profile
(:mod:`medley.fidelity.plans`); the loop (:mod:`medley.fidelity.loop`) trains it for real and
compares step time and peak memory (:mod:`medley.fidelity.results`); replay feeds each measured
step's compute back into the simulator (:mod:`medley.fidelity.replay`); the report is rendered
from the results alone (:mod:`medley.fidelity.fidelity_report`,
:mod:`medley.fidelity.replay_report`), and :mod:`medley.fidelity.harness` runs it all end to end
(``bench/fidelity.py``). It sits on the profiler (:mod:`medley.profile`), which measures the
machine."""

"""A plan lowered to the simulator's input and simulated: per-stage costs and the step's
:class:`~medley.sim.problem.SimProblem` (:mod:`medley.lowering.compile`), activation bytes
(:mod:`medley.lowering.activations`), ZeRO collectives over the sync segments
(:mod:`medley.lowering.collectives`), TP links (:mod:`medley.lowering.tp_links`) and the
prediction of a layout or a plan (:mod:`medley.lowering.predict`). The search, ``medley
simulate``, the preflight check and the fidelity harness ask it; the runtime never loads it."""

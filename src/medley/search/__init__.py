"""The planner. :func:`medley.search.planner.search` is the entry point; its stages, each a
subpackage that imports only the ones before it:

* :mod:`medley.search.space`: the vocabulary (structures, candidates, memory options, the
  searched families and depths);
* :mod:`medley.search.estimate`: what a candidate costs before it is simulated (the context one
  search shares, layer tables, bounds, the step estimate, the structure bound);
* :mod:`medley.search.rules`: how a structure becomes candidate layouts (the candidates, TP and
  asymmetric structures, the builder with its split and memory rules);
* :mod:`medley.search.rank`: the finalists simulated exactly and ranked (ranking, polish,
  shortfall, the named baselines);
* :mod:`medley.search.report`: what is shown beside the winner (``--explain``, the ablation,
  the reference search without pruning)."""

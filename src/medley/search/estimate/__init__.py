"""What a candidate costs before it is simulated: the context one search shares
(:mod:`.context`), per-layer tables (:mod:`.layer_table`), memory and time bounds
(:mod:`.bounds`), the analytic step estimate (:mod:`.step_estimate`) and the bound that prunes a
structure before any candidate of it is built (:mod:`.structure_bound`)."""

"""``medley check``'s dry run: every rank of a plan built by the run's own builder in a fake
process group on fake storage (:mod:`medley.dryrun.ranks`), its bytes traced against the
formulas' (:mod:`medley.dryrun.traced_bytes`), and the checkpoint its ranks would write
(:mod:`medley.dryrun.checkpoint_plan`). It reads the runtime; nothing in the runtime reads it."""

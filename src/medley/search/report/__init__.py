"""What is shown beside a search's winner: ``medley plan --explain`` (:mod:`.explain`), the
ablation of the planner's ideas (:mod:`.ablation`) and the reference search without pruning that
measures what pruning loses (:mod:`.reference_search`)."""

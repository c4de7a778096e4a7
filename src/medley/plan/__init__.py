"""A plan as the runtime reads it: the plan file (:mod:`medley.plan.plan`), its layout and layer
splits (:mod:`medley.plan.layout`), the layout of ``train``'s and ``simulate``'s inline flags
(:mod:`medley.plan.inline`), the sync segments between replicas (:mod:`medley.plan.segments`),
every replica's schedule (:mod:`medley.plan.world`) and a plan carried over to torch
(:mod:`medley.plan.export`). Nothing here loads the simulator, its lowering or the search."""

"""Starting the ranks of a plan: on this machine (:mod:`medley.launch.spawn`, ``medley train``),
across nodes (:mod:`medley.launch.nodes`: each node's command; :mod:`medley.launch.agents` and
:mod:`medley.launch.local_agent`: torchrun's elastic agent per node, ``medley launch``), and the
files an elastic run keeps beside its checkpoints (:mod:`medley.launch.elastic_dir`). Which plan
device a started rank is stays the runtime's (:mod:`medley.runtime.placement`)."""

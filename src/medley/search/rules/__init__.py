"""How a structure becomes candidate layouts: the candidates of a search (:mod:`.candidates`),
TP structures (:mod:`.tp_structures`) and replicas of their own shape (:mod:`.asymmetric`), the
builder (:mod:`.builder`) with its split rules (:mod:`.split_rules`, :mod:`.sweep`) and memory
rules (:mod:`.memory_rules`)."""

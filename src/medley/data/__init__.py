"""Training data, from a user's files to a step's micro-batches, below every package that trains:
``--data`` and its options to a source (:mod:`.load`), the source and the micro-batches a replica
takes (:mod:`.source`), file formats (:mod:`.formats`), token files and caches (:mod:`.tokens`,
:mod:`.cache`, :mod:`.streaming`), chat and prompt/answer examples (:mod:`.chat`,
:mod:`.examples`), the windows a global batch is cut from (:mod:`.windows`). Also the files shipped
with medley: the small training corpus (see NOTICE.md) and the BPE tokenizer trained on it
(:mod:`.bpe`)."""

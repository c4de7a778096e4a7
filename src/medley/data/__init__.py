"""Data files shipped with medley (the small training corpus, see NOTICE.md) and the BPE tokenizer
trained on it (:mod:`.bpe`)."""

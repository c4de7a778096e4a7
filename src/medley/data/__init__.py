"""Data files shipped with medley (the small training corpus, see NOTICE.md)."""

"""Training data: sources, formats, token caches and the windows a step's global batch is cut from
(:mod:`.source`, :mod:`.formats`, :mod:`.tokens`, :mod:`.cache`, :mod:`.windows`, :mod:`.load`)."""

from medley.runtime.data.load import SHIPPED_CORPUS, DataOptions, default_cache_dir, load_source
from medley.runtime.data.source import BYTE_VOCAB, SYNTHETIC, DataSource, Rows, decode, encode, replica_slice

VOCAB_SIZE = BYTE_VOCAB

__all__ = ["BYTE_VOCAB", "SHIPPED_CORPUS", "SYNTHETIC", "VOCAB_SIZE", "DataOptions", "DataSource", "Rows",
           "decode", "default_cache_dir", "encode", "load_source", "replica_slice"]

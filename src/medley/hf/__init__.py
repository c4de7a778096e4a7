"""Hugging Face model directories in and out, the files alone: the one map between medley's and
transformers' parameter names (:mod:`.names`), reading a directory's safetensors weights with
every check a user's files need (:mod:`.read`) and writing a model directory atomically
(:mod:`.write`). It knows nothing of medley's modules: the runtime gives it names and shapes and
places what it reads (:mod:`medley.runtime.hf_weights`), or hands it full tensors to write
(:mod:`medley.runtime.hf_export`)."""

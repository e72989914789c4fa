"""The sync methods the step runner (`edgc.runner`) runs: baselines, outer syncs, sparse, two-stage, codecs.

Modules:
    error_feedback.py `ErrorFeedbackReducer`: the one base of the sync methods that keep error feedback, and the
                      parts of it the two-stage all-reduce shares without being one.
    baselines.py      Baseline gradient compressors, each a `GradientReducer` (same hook, metrics and checkpoints as
                      EDGC).
    outer_sync.py     Sync methods for DiLoCo's outer step beside EDGC's PowerSGD, and what DiLoCo does with any
                      method's error feedback (decay, heal).
    outer_alloc.py    `AllocatedQuantState`: DiLoCo's quantised outer sync with the bits chosen per tensor, where
                      each byte removes the most error.
    outer_sparse.py   `SparseQuantState`: DiLoCo's outer sync as a chunked top-k with coded indices and 2-bit
                      values, all-gathered, with error feedback (the form of SparseLoCo).
    codecs.py         Codecs of the two-stage compressed all-reduce (`edgc.sync.two_stage`): rows of values to rows
                      of bytes whose size depends only on how many values a row carries, and back.
    flat_buffers.py   How the two-stage all-reduce lays out one call: buckets, the call's tensors as one flat run,
                      and its error feedback as one flat buffer.
    two_stage.py      The two-stage compressed all-reduce: the sync-method registry's third collective kind
                      (``TWO_STAGE``).
    sync_methods.py   The registry of sync methods: the compressors `edgc train`, `edgc bench` and `edgc simulate`
                      know by name.
"""

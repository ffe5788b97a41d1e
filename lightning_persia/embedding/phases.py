"""The phases of the trainer's embedding path, as ``torch.profiler.record_function`` spans.

They show in any profiler trace of a run (``torch.profiler.profile``, Lightning's ``PyTorchProfiler``), on the
thread that runs them: planning and sharding on the prefetch thread, encoding gradients on the push thread, the
rank merge on its own, the rest on the trainer's.
"""
from __future__ import annotations

PLAN = "persia.plan"  # a batch's ids deduplicated, bucketed by shard and encoded (prefetch thread)
LOOKUP_WAIT = "persia.lookup_wait"  # a forward waiting for its rows, and their move to the device
POOLED_LOOKUP = "persia.pooled_lookup"  # a twin's fused lookup over the batch-local rows
GRADIENT_PUSH = "persia.gradient_push"  # a step's gradient started on its way to the host and queued (trainer)
GRADIENT_ENCODE = "persia.gradient_encode"  # a step's gradient checked, encoded and handed to the shards (push thread)
MERGE = "persia.merge"  # the ranks' gradients gathered and summed (rank-merge thread)

PHASES = (PLAN, LOOKUP_WAIT, POOLED_LOOKUP, GRADIENT_PUSH, GRADIENT_ENCODE, MERGE)

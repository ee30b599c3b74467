"""Weight hand-off from a training engine to a rollout (inference) engine.

``Engine.weight_buckets`` streams the model as :class:`WeightBucket` objects: full tensors under Hugging Face
names, packed into flat buffers of at most ``bucket_bytes`` (a larger tensor is a bucket of its own), cast to
one dtype, numbered by ``version`` (the training step they come from) and ``index``, the last one flagged.
A receiver checks the stream with :class:`BucketReceiver`, so stale, partial or reordered weights are refused
instead of silently served. See docs/architecture.md §8.
"""

from .bucket import LORA_MODES, LoraMode, TensorSpec, WeightBucket
from .receiver import BucketReceiver, HandoffError
from .stream import DEFAULT_BUCKET_BYTES, bucket_tensors

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "LORA_MODES",
    "BucketReceiver",
    "HandoffError",
    "LoraMode",
    "TensorSpec",
    "WeightBucket",
    "bucket_tensors",
]

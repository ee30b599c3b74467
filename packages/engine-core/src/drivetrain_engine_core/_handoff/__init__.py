"""Weight hand-off from a training engine to a rollout (inference) engine.

``Engine.weight_buckets`` streams the model as :class:`WeightBucket` objects: full tensors under Hugging Face
names, packed into flat buffers of at most ``bucket_bytes`` (a larger tensor is a bucket of its own), cast to
one dtype, numbered by ``version`` (the training step they come from) and ``index``, the last one flagged,
each tensor with the digest of its bytes. A delta stream (``base_version``) sends only the tensors that
changed and lists the others. A receiver checks the stream with :class:`BucketReceiver`, so stale, partial,
reordered or wrongly based weights are refused instead of silently served, checks each bucket's tensors against
their digests as they arrive (:func:`check_arrived`), and checks what it serves against the digests
(:func:`verify_served`, when :class:`VerifyConfig` says). See docs/architecture.md §8.
"""

from .adapters import check_adapter_binding
from .bucket import LORA_MODES, LoraMode, TensorDigest, TensorSpec, WeightBucket
from .digest import digest_of
from .history import SentVersions
from .local_shards import ExportBytes, SentShards, ShardedWeight
from .metrics import SyncMetrics
from .receiver import BucketReceiver, DeltaBaseError, HandoffError
from .stream import DEFAULT_BUCKET_BYTES, BaseVersion, bucket_tensors
from .verify import VERIFY_MODES, VerifyConfig, VerifyMode, check_arrived, verify_served

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "LORA_MODES",
    "VERIFY_MODES",
    "BaseVersion",
    "BucketReceiver",
    "DeltaBaseError",
    "ExportBytes",
    "HandoffError",
    "LoraMode",
    "SentShards",
    "SentVersions",
    "ShardedWeight",
    "SyncMetrics",
    "TensorDigest",
    "TensorSpec",
    "VerifyConfig",
    "VerifyMode",
    "WeightBucket",
    "bucket_tensors",
    "check_adapter_binding",
    "check_arrived",
    "digest_of",
    "verify_served",
]

"""The device sampler: ``sample_rows`` (Triton, torch or Paddle tensors) over a step's ``SamplingBatch``, and its
float64 NumPy definition in ``reference``. README.md has the math, the random numbers and the layout."""

from fastdeploy_ext.ops.sampling.reference import filtered_probs, philox_uniform, reference_sample, reference_tokens


def __getattr__(name):
    # Triton is imported on first use, so that the reference works without it.
    if name in ("PenaltyCounts", "SamplingBatch", "SamplingOutput", "sample_rows", "MAX_LOGPROBS"):
        from fastdeploy_ext.ops.sampling import launcher

        return getattr(launcher, name)
    raise AttributeError(f"module 'fastdeploy_ext.ops.sampling' has no attribute {name!r}")


__all__ = ["MAX_LOGPROBS", "PenaltyCounts", "SamplingBatch", "SamplingOutput", "filtered_probs", "philox_uniform",
           "reference_sample", "reference_tokens", "sample_rows"]

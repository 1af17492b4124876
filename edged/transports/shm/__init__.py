"""The shared-memory transports: the native fast path and Triton's system shared memory."""

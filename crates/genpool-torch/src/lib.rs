//! genpool as a PyTorch pluggable allocator.

//! Mid-lived tier: stream-ordered allocation from a private cudaMemPool, with a front cache.

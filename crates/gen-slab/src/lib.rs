//! Short-lived tier: size classes over device chunks with lock-free free lists.

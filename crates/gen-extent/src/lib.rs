//! Large short/mid-lived tier: best-fit coalescing extent arena over one huge page-mapped region.

//! Long-lived tier: exact-fit buddy allocator with bitvec bitmaps over page-mapped regions.
